#!/usr/bin/env bash
# run 53, call 6 (one H100): the last 90 GPU kernel tests in collection order (c6_ids.txt),
# which hold the 29 that call 4's 330 s did not reach
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 240 -rfE \
  $(cat docs/perf/2026-12-05-h200-run53/c6_ids.txt) > $OUT/kernels_tail.log 2>&1
echo "kernels tail rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/kernels_tail.log
grep -E "^(FAILED|ERROR)" $OUT/kernels_tail.log | head -10
