#!/usr/bin/env bash
# run 54's follow-up, for the next session's first call (not yet run): the GPU tests of the
# WGRAD's 256 x 128 pick (the training layer at D=2880 F=2304 against torch autograd, EP=1
# and EP=2 on one GPU; the kernel's 256-row configs), then, on an H200, call 13's A/Bs (the
# pick against the old one at the layer) in what time is left
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/ops/test_training_gpu.py -k "wgrad_256 or partial_column_tiles" > $OUT/tests_train.log 2>&1
echo "training tests rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/tests_train.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_backward_kernels.py -k "test_gluon_wgrad and 256x128" > $OUT/tests_wgrad.log 2>&1
echo "wgrad kernel tests rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/tests_wgrad.log
left=$((560 - (SECONDS - t0)))
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ $left -gt 60 ]; then
  BUDGET=$left bash docs/perf/2026-12-05-h200-run54/run_c13.sh
fi
