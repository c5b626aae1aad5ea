#!/usr/bin/env bash
# run 48, call 3 (one H200): "auto" with the rows copied (the default since call 2) against
# "auto" reading them in place (autoip) and the other modes, in the same rounds.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
for spec in "olmoe 8 0.75,0.9 sampled" "issue-a 4 0.6,0.85 exact"; do
  set -- $spec
  left=$((400 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/budget_step.py --shape $1 --layers $2 --factors $3 --routing $4 \
    --modes rows,x,auto,autoip --rounds 9 --iters 3 --csv $OUT/budget_$1.csv \
    > $OUT/budget_$1.log 2>&1
  echo "$1 rc=$? at $((SECONDS - t0)) s"
  tail -n 14 $OUT/budget_$1.log
done
