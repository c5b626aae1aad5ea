#!/usr/bin/env bash
# run 54, call 6 (one H100): the fwd+bwd bench against the torch baseline after runs 51-53's
# lockstep picks, deepseek-v3 first, sampled then exact routing, ceilings in the same run
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for routing in sampled exact; do
  left=$((${BUDGET:-540} - (SECONDS - t0))); [ $left -lt 90 ] && break
  timeout $left python3 -m distmoe bench --mode fwdbwd --shapes deepseek-v3 issue-a fine \
    --routing $routing --providers distmoe torch --no-plots --out $OUT/bench_$routing \
    > $OUT/bench_$routing.log 2>&1
  echo "bench $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^(distmoe|torch|shape|ceiling|dense)" $OUT/bench_$routing.log | cut -c1-140 | head -20
done
