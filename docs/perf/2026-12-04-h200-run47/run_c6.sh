#!/usr/bin/env bash
# run 47, call 6 (one H200): the in-place WGRAD's producer loads a tile's first addresses
# during the previous tile's last step (calls 3-5: at each tile's start, a wait that a
# 256-row expert, four steps a tile, pays often). GPU tests of the kernel and of training
# in place; the kernel alone at fine and olmoe; the layer, copy and in place in the same rounds.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 150 python3 -m pytest -v -p no:cacheprovider -k "inplace or x_rows" \
  tests/ops/test_training_gpu.py tests/kernels/test_backward_kernels.py > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest.log | head -20; tail -n 2 $OUT/pytest.log
timeout 100 python3 tools/tune_wgrad.py --quick --shapes fine olmoe --routing random \
  --csv $OUT/tune_wgrad.csv > $OUT/tune_wgrad.log 2>&1
echo "tune_wgrad rc=$? at $((SECONDS - t0)) s"
grep -E "^[a-z-]+ \(|HEURISTIC|256x128 k64 s3 w8 GLUON WS" $OUT/tune_wgrad.log | grep -v "w2_wgrad" | head -30
for spec in "fine exact 9" "fine sampled 7" "olmoe sampled 7"; do
  set -- $spec
  left=$((430 - (SECONDS - t0))); [ $left -lt 50 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds $3 \
    --iters 10 --regather --regather-in-place both > $OUT/inplace_$1_$2.log 2>&1
  echo "$1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +(base|regather|inplace) " $OUT/inplace_$1_$2.log
done
