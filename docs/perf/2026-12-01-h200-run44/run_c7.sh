#!/usr/bin/env bash
# run 44, call 7 (one H200): the GPU tests calls 1-6 did not run that touch this session's
# changes: the Gluon W2 beside W13 and W13 in phases (the W2 kernel now takes the weight
# orientation), the bench tools (launch() from a fork server), the routing tables
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o7; mkdir -p $out
t0=$SECONDS
timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w2_beside.py \
  tests/kernels/test_w13_phases.py tests/tools/test_bench_gpu.py tests/tools/test_bench_telemetry.py \
  tests/kernels/test_backward_kernels.py::test_gluon_w2_dgrad_heuristic > $out/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 4 $out/tests.log | cut -c1-300
tar czf /tmp/g7.tgz -C $out . && cp /tmp/g7.tgz $OUT/
