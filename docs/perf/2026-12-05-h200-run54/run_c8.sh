#!/usr/bin/env bash
# run 54, call 8 (one H100): call 7 found the two WGRADs 8.8% slower at deepseek-v3 under exact
# routing (128 rows for every expert: 14.09 against 12.94 ms a step) while every other GEMM got
# faster; the WGRAD kernels alone under both routings, the Gluon configs (--quick)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout ${BUDGET:-300} python3 tools/tune_wgrad.py --shapes deepseek-v3 --routing balanced random \
  --quick --csv $OUT/wgrad_deepseek-v3.csv > $OUT/wgrad_deepseek-v3.log 2>&1
echo "tune_wgrad rc=$? at $((SECONDS - t0)) s"
grep -vE "^\s*$|warn" $OUT/wgrad_deepseek-v3.log | cut -c1-160 | head -60
