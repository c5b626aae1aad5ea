#!/usr/bin/env bash
# run 53, call 4 (one H100): the whole GPU test suite (pytest -m gpu), kernels first, four
# workers (pytest-xdist: the kernels' builds are CPU-bound), then ops, routing, runtime, tools
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 --timeout 240 -rfE \
  tests/kernels > $OUT/kernels.log 2>&1
echo "kernels rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/kernels.log
grep -E "^(FAILED|ERROR)" $OUT/kernels.log | head -10
left=$((585 - (SECONDS - t0)))
timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -n 2 --timeout 240 -rfE \
  tests/ops tests/routing tests/runtime tests/tools > $OUT/rest.log 2>&1
echo "rest rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/rest.log
grep -E "^(FAILED|ERROR)" $OUT/rest.log | head -10
