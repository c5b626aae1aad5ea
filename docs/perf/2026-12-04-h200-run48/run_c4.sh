#!/usr/bin/env bash
# run 48, call 4 (one H200): after the Gluon WGRAD producer's three walks (TMA, table,
# in order) became one helper: the Gluon WGRAD kernel tests and the in-place training modes.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_backward_kernels.py \
  -k "gluon_wgrad" > $OUT/pytest_kernels.log 2>&1
echo "kernels rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/pytest_kernels.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_training_gpu.py \
  -k "inplace" > $OUT/pytest_training.log 2>&1
echo "training rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/pytest_training.log
