#!/usr/bin/env bash
# run 54, call 4 (one H100): deepseek-v3's fwd+bwd layer, two variants per process (three do
# not fit 80 GB), expandable segments: the heuristic against all three lockstep options off
# and against the W2 DGRAD's off, under sampled and exact routing
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
ab() {  # routing name spec rounds
  timeout 150 python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd \
    --routing $1 --rounds $4 --variant $2=$3 > $OUT/ab_$2_$1.log 2>&1
  echo "ab $2 $1 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$2_$1.log | head -2
}
alloff=w13:lockstep=False+w2:lockstep=False+w2_dgrad:lockstep=False
ab sampled alloff $alloff 9
ab exact alloff $alloff 9
ab exact off w2_dgrad:lockstep=False 9
ab sampled off w2_dgrad:lockstep=False 9
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
