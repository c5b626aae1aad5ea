#!/usr/bin/env bash
# run 53, call 5 (one H200: deepseek-v3's layer fwd+bwd does not fit an H100): the heuristic
# (W13 forward, W2 forward and W2 DGRAD producers in lockstep there) against the W2 DGRAD's
# off and against all three off, interleaved, sampled then exact routing (ROUTINGS, BUDGET:
# the routings and the seconds this script may take)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for routing in ${ROUTINGS:-sampled exact}; do
  left=$((${BUDGET:-400} - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd \
    --routing $routing --rounds 7 --variant off=w2_dgrad:lockstep=False \
    --variant alloff=w13:lockstep=False+w2:lockstep=False+w2_dgrad:lockstep=False \
    > $OUT/ab_deepseek-v3_$routing.log 2>&1
  echo "ab deepseek-v3 $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_deepseek-v3_$routing.log | head -3
done
