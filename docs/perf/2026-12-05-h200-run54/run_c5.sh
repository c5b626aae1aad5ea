#!/usr/bin/env bash
# run 54, call 5 (one H100): which lockstep option gives deepseek-v3's fwd+bwd layer its gain
# under sampled routing (the W13 forward's off, the W2 forward's off), then deepseek-v4-flash
# (fits three variants) against all three off and the W2 DGRAD's off
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
ab() {  # shape routing log-name variant...
  shape=$1 routing=$2 name=$3; shift 3
  timeout 150 python3 tools/ab_interleaved.py --shape $shape --mode fwdbwd \
    --routing $routing --rounds 9 "$@" > $OUT/ab_${shape}_${name}_$routing.log 2>&1
  echo "ab $shape $name $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_${shape}_${name}_$routing.log | head -3
}
ab deepseek-v3 sampled w13off --variant w13off=w13:lockstep=False
ab deepseek-v3 sampled w2off --variant w2off=w2:lockstep=False
ab deepseek-v4-flash sampled three --variant alloff=w13:lockstep=False+w2:lockstep=False+w2_dgrad:lockstep=False \
  --variant off=w2_dgrad:lockstep=False
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
