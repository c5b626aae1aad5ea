#!/usr/bin/env bash
# run 51, call 5: call 4's lockstep build gave other bits than the heuristic's under random
# routing (same bits under exact routing): which rows differ and how, the heuristic run twice,
# then the timing regardless
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
D=docs/perf/2026-12-05-h200-run51
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 200 python3 $D/w13_l2.py time random --lockstep > $OUT/time_random.log 2>&1
echo "time random rc=$? at $((SECONDS - t0)) s"; cat $OUT/time_random.log | cut -c1-200 | tail -n 40
