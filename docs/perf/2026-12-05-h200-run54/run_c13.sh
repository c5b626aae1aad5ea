#!/usr/bin/env bash
# run 54, call 13 (one H200 if lent): the 256 x 128 warp-specialised WGRAD ("wide") against
# the heuristic at the layer on an H200, where calls 11-12 measured it on an H100 only
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
wide=wgrad:specialized=True,pingpong=False,num_stages=3,num_warps=8,block_out_m=256
for spec in "deepseek-v3 sampled" "deepseek-v4-flash sampled" "issue-a sampled" "deepseek-v3 exact"; do
  set -- $spec
  left=$((${BUDGET:-95} - (SECONDS - t0))); [ $left -lt 20 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds 7 --variant wide=$wide > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2
done
