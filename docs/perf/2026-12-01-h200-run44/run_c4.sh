#!/usr/bin/env bash
# run 44, call 4 (one H200): the heuristic now picks the Gluon W13 DGRAD (ping-pong 128 x 128
# tiles) from 128 rows per expert where the rank's W13 weights total under 2 GiB, and launch()
# starts ranks from a fork server. GPU tests: the W13 DGRAD ones, the Gluon W2 forward's (its
# kernel took the weight orientation as a parameter), the training layer end to end (EP=1, EP=2
# on one GPU through launch(), CUDA-graph step), the forward's GPU tests (EP=2/4 on one GPU),
# the heap's; then the fwd+bwd bench under both routings.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o4; mkdir -p $out
t0=$SECONDS
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_training_gpu.py \
  tests/ops/test_forward_gpu.py tests/runtime/test_heap.py \
  tests/kernels/test_backward_kernels.py -k "w13_dgrad or training or forward or heap or chain" \
  > $out/tests_a.log 2>&1
echo "tests A rc=$? at $((SECONDS - t0)) s"; tail -n 3 $out/tests_a.log | cut -c1-300
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_forward_kernels.py \
  -k "w2_gluon" > $out/tests_b.log 2>&1
echo "tests B rc=$? at $((SECONDS - t0)) s"; tail -n 3 $out/tests_b.log | cut -c1-300
for r in exact sampled; do
  left=$((570 - (SECONDS - t0)))
  [ $left -lt 60 ] && { echo "bench $r skipped (time)"; continue; }
  timeout $left python3 -m distmoe bench --mode fwdbwd --shapes issue-a fine issue-b olmoe deepseek-v3 \
    --routing $r --providers distmoe torch --no-plots --out $out/bench_$r > $out/bench_$r.log 2>&1
  echo "bench $r rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch|ceiling dense)" $out/bench_$r.log | cut -c1-120 | head -20
done
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
