#!/usr/bin/env bash
# run 58, call 15 (any Hopper GPU): the GPU tests of the expert-group order after its tile
# lookup was folded into one (no spill at 256 experts), and of the Gluon W13 in lockstep.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_forward_kernels.py -k "expert_groups or w13_gluon_lockstep" \
  > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -n 3 $OUT/tests.log
