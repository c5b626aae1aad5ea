#!/usr/bin/env bash
# run 60, call 8 (one H100): the W13 DGRAD's expert-group order now from 128 rows per expert
# (call 7: the kernel 1.05-1.09x at 128). The GPU tests that see the pick (the training
# partial-tile test asserts it at EP=1's 128 rows now), then the fwd+bwd layer against the
# old pick at 128 rows per expert (`old`: the W13 DGRAD's order off; x < 1: the new pick
# faster).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 3 -rfE \
  tests/ops/test_training_gpu.py tests/kernels/test_backward_kernels.py \
  -k "partial_column_tiles or w13_dgrad_heuristic or w13_dgrad_expert_groups" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/tests.log
ab issue-b fwdbwd sampled 9 old=w13_dgrad:expert_groups=False
ab olmoe@1024 fwdbwd sampled 9 old=w13_dgrad:expert_groups=False
