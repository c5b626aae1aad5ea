#!/usr/bin/env bash
# run 48, call 2 (one H200): under "auto" at EP=1 the in-place W13 WGRAD serves every layer
# (x's rows through the table, kept rows in order: x_offset [start, in_order] from the slot
# program). GPU tests of the kernels and training modes; then tools/budget_step.py again
# (with saved-auto: the roomy slot in the auto mode).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 240 python3 -m pytest -v -p no:cacheprovider tests/ops/test_training_gpu.py \
  "tests/kernels/test_backward_kernels.py::test_gluon_wgrad_x_rows" \
  "tests/kernels/test_backward_kernels.py::test_w13_wgrad_x_rows" \
  "tests/ops/test_activations.py::test_slot_cursor_kernel_matches_torch_ops" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest.log | head -20; tail -n 2 $OUT/pytest.log
for spec in "olmoe 8 0.6,0.75,0.9 sampled" "issue-a 4 0.6,0.85 exact" \
            "fine 8 0.6,0.75,0.9 exact"; do
  set -- $spec
  left=$((560 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/budget_step.py --shape $1 --layers $2 --factors $3 --routing $4 \
    --rounds 7 --iters 3 --csv $OUT/budget_$1.csv > $OUT/budget_$1.log 2>&1
  echo "$1 rc=$? at $((SECONDS - t0)) s"
  tail -n 13 $OUT/budget_$1.log
done
