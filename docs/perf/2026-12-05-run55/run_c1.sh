#!/usr/bin/env bash
# run 55, call 1: the GPU tests run 54 wrote but never ran (the training layer with the
# WGRAD's 256 x 128 tiles at D=2880 F=2304, EP=1 and EP=2 on one GPU; the partial-column
# test; the kernel's 256-row configs) and the lockstep kernels' tests (their launchers'
# counter now comes from _common.lockstep_counter, 8fdfec8)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=5 \
  tests/ops/test_training_gpu.py -k "wgrad_256 or partial_column_tiles" > $OUT/tests_train.log 2>&1
echo "training tests rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/tests_train.log
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_backward_kernels.py tests/kernels/test_forward_kernels.py \
  -k "(test_gluon_wgrad and 256x128) or lockstep" > $OUT/tests_kernels.log 2>&1
echo "kernel tests rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/tests_kernels.log
