#!/usr/bin/env bash
# run 45, call 4 (one H200): what the training W13 forward's stores cost (call 3: the kernel
# at fine waits on memory): the heuristic's W13 timed storing h2 only (inference), h2 + h1,
# and h2 + h1 + the gathered rows (the training forward), fine / olmoe / issue-a
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 500 python3 tools/tune_gemm.py --shapes fine olmoe issue-a --kernels w13 w13_h1 w13_train \
  --final 2 --rounds 9 --csv $OUT/tune.csv > $OUT/tune.log 2>&1
echo "tune rc=$? at $((SECONDS - t0)) s"
grep -iE "heuristic|final|interleaved|^ *(w13|shape)|torch" $OUT/tune.log | head -60
