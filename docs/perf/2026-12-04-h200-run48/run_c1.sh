#!/usr/bin/env bash
# run 48, call 1 (one H200): MoEConfig.save_gathered_rows="auto" (each layer keeps its rows,
# x or its input, chosen on the device). GPU tests of the training modes (last session's
# rewrites included) and of the slot kernel; then tools/budget_step.py: a stack of layers in
# one slot under three budgets, the three modes and a roomy slot in the same rounds.
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
for spec in "fine 8 0.6,0.75,0.9 sampled" "olmoe 8 0.6,0.75,0.9 sampled" \
            "issue-a 4 0.6,0.85 exact"; do
  set -- $spec
  left=$((540 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/budget_step.py --shape $1 --layers $2 --factors $3 --routing $4 \
    --rounds 7 --iters 3 --csv $OUT/budget_$1.csv > $OUT/budget_$1.log 2>&1
  echo "$1 rc=$? at $((SECONDS - t0)) s"
  tail -n 12 $OUT/budget_$1.log
done
