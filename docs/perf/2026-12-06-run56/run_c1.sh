#!/usr/bin/env bash
# run 56 call 1 (run 55 run_c10.sh as written): the WGRAD lockstep pick (DeepSeek-V3's
# W13 WGRAD, 56 MiB an expert) on an H200 or H100: its GPU tests, the layer with the pick
# against without (variant "off"; ratio < 1: the pick is faster) under both routings, then
# the bench after the pick. Set DEADLINE to the seconds the call may use.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-560}
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_backward_kernels.py -k "test_gluon_wgrad_lockstep" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/tests.log
for r in sampled exact; do
  left=$((D - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd --routing $r \
    --rounds 9 --variant off=w13_wgrad:lockstep=False > $OUT/ab_deepseek-v3_$r.log 2>&1
  echo "ab $r rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_deepseek-v3_$r.log | head -2
done
left=$((D - (SECONDS - t0)))
if [ $left -gt 120 ]; then
  timeout $left python3 -m distmoe bench --mode fwdbwd --shapes deepseek-v3 issue-a fine \
    --routing exact --providers distmoe torch --no-plots --out $OUT/bench_exact \
    > $OUT/bench_exact.log 2>&1
  echo "bench rc=$? at $((SECONDS - t0)) s"
  grep -E "^(distmoe|torch|ceiling dense)" $OUT/bench_exact.log | cut -c1-140 | head -8
fi
