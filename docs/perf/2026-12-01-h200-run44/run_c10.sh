#!/usr/bin/env bash
# run 44, call 10 (one H200): GPU tests after this session's CPU-only follow-ups: the W13
# DGRAD heuristic's per-expert bound, the shared Gluon config check (W13 and W2 forward, W13
# DGRAD), the scored W2 DGRAD tests' shared route-row set-up, check mode's NamedTuple
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o10; mkdir -p $out
t0=$SECONDS
timeout 430 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_backward_kernels.py tests/kernels/test_forward_kernels.py \
  -k "gluon_w2_dgrad_scored or split_epilogue or heuristic or training" \
  tests/ops/test_training_gpu.py > $out/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 4 $out/tests.log | cut -c1-300
tar czf /tmp/g10.tgz -C $out . && cp /tmp/g10.tgz $OUT/
