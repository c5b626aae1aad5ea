#!/usr/bin/env bash
# run 47, call 4 (one H200): the x_rows W13 WGRAD with its own pick (256 x 128 tiles, 8 MMA
# warps, 3 stages: each gathered B row once per 256 output rows).
# 1. GPU tests (kernels with 128- and 256-row tiles, training against autograd, CUDA graphs);
# 2. the layer: tools/ab_interleaved.py --regather (--replay at fine exact);
# 3. the 256 x 128 warp-specialised WGRAD (TMA-fed) against the heuristic in the default mode.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 200 python3 -m pytest -v -p no:cacheprovider -k "x_rows or config_rules" \
  tests/kernels/test_backward_kernels.py > $OUT/pytest_kernels.log 2>&1
echo "pytest kernels rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest_kernels.log | head -20; tail -n 2 $OUT/pytest_kernels.log
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/ops/test_training_gpu.py \
  > $OUT/pytest_training.log 2>&1
echo "pytest training rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest_training.log | head -20; tail -n 2 $OUT/pytest_training.log
for spec in "fine exact 9 --replay" "issue-a exact 7" "olmoe sampled 7" "fine sampled 7"; do
  set -- $spec
  left=$((540 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds $3 \
    --iters 10 --regather ${4:-} > $OUT/regather_$1_$2.log 2>&1
  echo "$1 $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "layer: activation|^ +(base|replay|regather) " $OUT/regather_$1_$2.log
done
left=$((580 - (SECONDS - t0)))
if [ $left -ge 45 ]; then
  timeout $left python3 tools/ab_interleaved.py --shape issue-a --mode fwdbwd --routing exact \
    --rounds 7 --iters 10 \
    --variant w256=wgrad:block_out_m=256,num_warps=8,num_stages=3,pingpong=False \
    > $OUT/wgrad256_issue-a.log 2>&1
  echo "wgrad256 issue-a rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +(base|w256) " $OUT/wgrad256_issue-a.log
fi
