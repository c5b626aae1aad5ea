#!/usr/bin/env bash
# run 53, call 1: the lockstep GPU tests (the wait folded into _lockstep_before_tile; the
# new W2DgradConfig.lockstep and W13DgradConfig.lockstep), the sm_90 build check, then the
# DGRAD kernels alone with and without lockstep (dgrad_micro.py)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
d=docs/perf/2026-12-05-h200-run53
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_forward_kernels.py \
  tests/kernels/test_backward_kernels.py -k "lockstep or gluon_w13_dgrad or w2_dgrad_split or \
w2_dgrad_partial or w2_gluon_programs" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 4 $OUT/tests.log
left=$((560 - (SECONDS - t0)))
timeout $left python3 $d/dgrad_micro.py --rounds 11 deepseek-v3 gpt-oss-120b issue-b fine \
  deepseek-v4-flash > $OUT/micro.log 2>&1
echo "micro rc=$? at $((SECONDS - t0)) s"; cat $OUT/micro.log | grep -v "^\s*$" | tail -n 12
