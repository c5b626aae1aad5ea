#!/usr/bin/env bash
# run 43, call 4 (one H200): the W2 DGRAD heuristic now picks the split kernel (8 epilogue
# warps). GPU tests on it (heuristic, the training layer end to end at EP=1 and EP=2 on one
# GPU, CUDA-graph training step) and on the bench harness's RNG reset after a failed
# capture; then layer fwd+bwd A/Bs, base = the split kernel, variant pp = the ping-pong
# kernel (run 42's production); then, in what time is left, the fwd+bwd bench at exact
# routing.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o4; mkdir -p $out
t0=$SECONDS
timeout 175 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_training_gpu.py \
  tests/tools/test_bench_gpu.py tests/tools/test_bench_telemetry.py \
  "tests/kernels/test_backward_kernels.py::test_gluon_w2_dgrad_heuristic" > $out/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 4 $out/tests.log | cut -c1-300
AB="python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --variant pp=w2_dgrad:epilogue_warps=0"
for spec in "fine exact 7" "issue-a exact 7" "olmoe sampled 7" "deepseek-v3 sampled 5" "issue-b sampled 7" "fine sampled 7"; do
  set -- $spec
  left=$((545 - (SECONDS - t0)))
  [ $left -lt 45 ] && { echo "ab $1 $2 skipped (time)"; continue; }
  timeout $(( left < 90 ? left : 90 )) $AB --shape $1 --routing $2 --rounds $3 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|pp) " $out/ab_$1_$2.log
done
left=$((560 - (SECONDS - t0)))
if [ $left -ge 75 ]; then
  timeout $left python3 -m distmoe bench --mode fwdbwd --shapes issue-a fine issue-b olmoe deepseek-v3 \
    --routing exact --providers distmoe torch --no-plots --out $out/bench_exact > $out/bench_exact.log 2>&1
  echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch) " $out/bench_exact.log | cut -c1-100
fi
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
