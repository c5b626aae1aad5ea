#!/usr/bin/env bash
# call 9 (nvidia-h200-x2, 5249bdf): the two-GPU training tests with the warp-specialised WGRAD
export PYTHONPATH=src; mkdir -p $OUT
timeout 140 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py -k "training" -x 2>&1 \
  | tail -4 | tee $OUT/t_multi_training.log
