#!/usr/bin/env bash
# run 46, call 1 (one H200): MoEConfig.save_gathered_rows=False (saved layers keep x [T, D]
# instead of x_rows [R, D]; the backward gathers the rows again with regather_rows).
# 1. its GPU tests: the new kernel, training against torch autograd (EP=1 symmetric memory,
#    EP=2 as two ranks on one GPU), the CUDA-graph step with new inputs, slot-cursor kernel;
# 2. what it costs: tools/ab_interleaved.py --regather --replay, same rounds as the default.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 240 python3 -m pytest -v -p no:cacheprovider tests/kernels/test_regather_rows.py \
  tests/ops/test_training_gpu.py "tests/ops/test_activations.py::test_slot_cursor_kernel_matches_torch_ops" \
  > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest.log | head -20; tail -n 2 $OUT/pytest.log
for spec in "fine exact 9" "issue-a exact 7" "olmoe sampled 7" "fine sampled 7"; do
  set -- $spec
  left=$((560 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds $3 \
    --iters 10 --replay --regather > $OUT/regather_$1_$2.log 2>&1
  echo "$1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "layer: activation|^ +(base|replay|regather) " $OUT/regather_$1_$2.log
done
