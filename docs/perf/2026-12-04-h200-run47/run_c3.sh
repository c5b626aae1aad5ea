#!/usr/bin/env bash
# run 47, call 3 (one H200): the gathering producer as 2 warps, 4 rows x 128 bytes per instruction,
# each step's addresses loaded one step ahead (call 2: no prefetch, 1.6-2.1x slower at fine).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 200 python3 -m pytest -v -p no:cacheprovider -k "x_rows" \
  tests/kernels/test_backward_kernels.py > $OUT/pytest_kernels.log 2>&1
echo "pytest kernels rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest_kernels.log | head -20; tail -n 2 $OUT/pytest_kernels.log
timeout 150 python3 tools/tune_wgrad.py --quick --shapes fine issue-a --routing random \
  --csv $OUT/tune_wgrad.csv > $OUT/tune_wgrad.log 2>&1
echo "tune_wgrad rc=$? at $((SECONDS - t0)) s"
grep -E "^[a-z-]+ \(|HEURISTIC|256x128" $OUT/tune_wgrad.log | grep -v "w2_wgrad" | head -60
for spec in "fine exact 7"; do
  set -- $spec
  left=$((560 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds $3 \
    --iters 10 --regather > $OUT/regather_$1_$2.log 2>&1
  echo "$1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +(base|replay|regather) " $OUT/regather_$1_$2.log
done
