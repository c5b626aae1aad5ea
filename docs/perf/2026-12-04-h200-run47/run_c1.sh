#!/usr/bin/env bash
# run 47, call 1 (one H200): at EP=1 a layer that kept x (MoEConfig.save_gathered_rows False)
# has its W13 WGRAD read x's rows in place through the gather table (cp.async by address in
# the warp-specialised Gluon WGRAD; pointer loads in the Triton one): no regather_rows copy.
# 1. GPU tests: the Gluon and Triton WGRAD with x_rows against the rows stored in order (same
#    bits), training against torch autograd (every mode), the CUDA-graph step, the slot cursor;
# 2. the kernel: tools/tune_wgrad.py --quick (w13_wgrad against w13_wgrad_x_rows);
# 3. the layer: tools/ab_interleaved.py --regather --replay, same rounds as the default.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 240 python3 -m pytest -v -p no:cacheprovider -k "x_rows or w13_wgrad" \
  tests/kernels/test_backward_kernels.py > $OUT/pytest_kernels.log 2>&1
echo "pytest kernels rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest_kernels.log | head -20; tail -n 2 $OUT/pytest_kernels.log
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/ops/test_training_gpu.py \
  "tests/ops/test_activations.py::test_slot_cursor_kernel_matches_torch_ops" \
  > $OUT/pytest_training.log 2>&1
echo "pytest training rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest_training.log | head -20; tail -n 2 $OUT/pytest_training.log
timeout 120 python3 tools/tune_wgrad.py --quick --shapes fine issue-a olmoe \
  --routing random balanced --csv $OUT/tune_wgrad.csv > $OUT/tune_wgrad.log 2>&1
echo "tune_wgrad rc=$? at $((SECONDS - t0)) s"
grep -E "^[a-z-]+ \(|HEURISTIC|WS" $OUT/tune_wgrad.log | grep -v "w2_wgrad" | head -60
for spec in "fine exact 9" "issue-a exact 7" "olmoe sampled 7" "fine sampled 7"; do
  set -- $spec
  left=$((570 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds $3 \
    --iters 10 --replay --regather > $OUT/regather_$1_$2.log 2>&1
  echo "$1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "layer: activation|^ +(base|replay|regather) " $OUT/regather_$1_$2.log
done
