#!/usr/bin/env bash
# run 45, call 5 (one H200): issue 7's first target read again at issue-a on a fresh machine
# (call 4 read the fused inference W13 at 1.08x torch._grouped_mm by do_bench, 1.069x
# interleaved; run 29 had 0.98x / 1.023x): the W13 kernels only, 15 interleaved rounds
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
t0=$SECONDS
timeout 400 python3 tools/tune_gemm.py --shapes issue-a --kernels w13 --final 2 --rounds 15 \
  --csv $OUT/tune.csv > $OUT/tune.log 2>&1
echo "tune rc=$? at $((SECONDS - t0)) s"
grep -iE "HEURISTIC|interleaved|^ *(w13|issue)|torch" $OUT/tune.log | head -20
