#!/usr/bin/env bash
# run 43, call 2 (one H200): the GPU tests call 1 had no time for (training layer, routing tables,
# heap, bench tools), then the bench at EP=1 (both modes, five suite shapes, both routings) with
# run 42's WGRAD pick (warp-specialised cooperative 128 x 128 from 1024 rows per expert).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o2; mkdir -p $out
t0=$SECONDS
timeout 135 python3 -m pytest -v -m "gpu" -p no:cacheprovider --durations=15 \
  tests/ops/test_training_gpu.py tests/routing tests/runtime tests/tools > $out/pytest_rest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $out/pytest_rest.log | head -20; tail -n 3 $out/pytest_rest.log
for r in exact sampled; do
  left=$((585 - (SECONDS - t0))); lim=$(( left < 235 ? left : 235 ))
  timeout $lim python3 -m distmoe bench --mode both --shapes issue-a fine issue-b olmoe deepseek-v3 \
    --routing $r --providers distmoe torch --no-plots --out $out/bench_$r > $out/bench_$r.log 2>&1
  echo "bench $r rc=$? at $((SECONDS - t0)) s"; tail -n 32 $out/bench_$r.log | grep -v "^$" | cut -c1-140
done
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
