#!/usr/bin/env bash
# run 47, call 5 (one H200): MoEConfig.gathered_rows_in_place and its rule (in place from 512
# rows per local expert at EP=1). GPU tests of every mode; then, in the same rounds, the
# default layer, the copying one and the in-place one (--regather --regather-in-place both).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 240 python3 -m pytest -v -p no:cacheprovider tests/ops/test_training_gpu.py \
  "tests/kernels/test_backward_kernels.py::test_gluon_wgrad_x_rows" \
  "tests/kernels/test_backward_kernels.py::test_w13_wgrad_x_rows" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest.log | head -20; tail -n 2 $OUT/pytest.log
for spec in "fine exact 9" "olmoe sampled 7" "issue-a exact 5" "fine sampled 7"; do
  set -- $spec
  left=$((500 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds $3 \
    --iters 10 --regather --regather-in-place both > $OUT/inplace_$1_$2.log 2>&1
  echo "$1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "layer: activation|^ +(base|regather|inplace) " $OUT/inplace_$1_$2.log
done
