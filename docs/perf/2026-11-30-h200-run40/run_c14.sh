#!/usr/bin/env bash
# call 14 (two H200s, nvidia-h200-x2): the two-GPU training tests with the W13 DGRAD's
# dynamic hand-out and paired tails on by heuristic (the command as run, output in
# c14_t_multi_training.log)
export PYTHONPATH=src
timeout 140 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py -k "training" -x 2>&1 \
  | tail -4 | tee $OUT/t_multi_training.log
