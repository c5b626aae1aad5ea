#!/usr/bin/env bash
# run 45, call 2 (one H200): the GPU test suite's second half (training layer, EP=2 through
# launch() on one GPU, routing tables, heap, bench tools), then what replaying every layer
# in backward costs with this session's kernels: tools/ab_interleaved.py --replay (the same
# layer with activation_factor 0, timed in the same rounds as the saved one).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 230 python3 -m pytest -v -m "gpu or multigpu" -p no:cacheprovider --durations=10 \
  --junitxml=$OUT/junit2.xml tests --ignore=tests/kernels --ignore=tests/ops/test_forward_gpu.py \
  > $OUT/pytest2.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest2.log | head -20; tail -n 2 $OUT/pytest2.log
for spec in "fine exact 9" "fine sampled 9" "issue-a exact 7" "olmoe sampled 7" "deepseek-v3 sampled 7"; do
  set -- $spec
  left=$((570 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds $3 \
    --iters 10 --replay > $OUT/replay_$1_$2.log 2>&1
  echo "$1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "layer: activation|^ +(base|replay) " $OUT/replay_$1_$2.log
done
