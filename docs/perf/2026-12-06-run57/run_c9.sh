#!/usr/bin/env bash
# run 57, call 9 (not run: for the next session, any Hopper GPU): does the W13 forward lose
# its DRAM rate to its gathered rows? `w13_rows_probe.py` (the kernel alone over DeepSeek-V3's
# weights, rows routed / pre-sorted / L2-hot, inference and training; a small correctness
# check first), and run 56's TMA stream probe for the ceiling in the same call.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
here=$(dirname "$0")
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
timeout 240 python3 "$here/w13_rows_probe.py" --check --rounds 3 > $OUT/rows_probe.log 2>&1
echo "rows probe rc=$? at $((SECONDS - t0)) s"; tail -n 12 $OUT/rows_probe.log
timeout 150 python3 "$here/../2026-12-06-run56/tma_stream.py" --rounds 3 > $OUT/tma_stream.log 2>&1
echo "tma probe rc=$? at $((SECONDS - t0)) s"; tail -n 10 $OUT/tma_stream.log
