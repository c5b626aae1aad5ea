#!/usr/bin/env bash
# run 59, calls 2-3 (any Hopper GPU; call 2 stopped at its test timeout and a variant spec): the expert-group tile order on the W2 forward and the W13
# DGRAD (W2Config / W13DgradConfig.expert_groups, one kernel): its GPU tests (and the W13
# forward's again), then the layer against the heuristic (x > 1 on a variant's line:
# faster). The h2 / grad_h1 rows are read by TMA from contiguous rows, 56 column tiles per
# row block at DeepSeek-V3 (D = 7168): in group-M 8 order a row block's tiles spread over
# about three waves.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_forward_kernels.py tests/kernels/test_backward_kernels.py \
  -k "w2_gluon_expert_groups or w13_dgrad_expert_groups" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/tests.log
ab deepseek-v3 fwd sampled 11 eg2=w2:expert_groups=True
ab gpt-oss-120b fwd sampled 9 eg2=w2:expert_groups=True
ab fine fwd sampled 9 eg2=w2:expert_groups=True
ab deepseek-v3 fwdbwd sampled 7 eg2=w2:expert_groups=True \
  egd=w13_dgrad:expert_groups=True
ab fine fwdbwd sampled 7 eg2=w2:expert_groups=True egd=w13_dgrad:expert_groups=True
ab olmoe@1024 fwd sampled 9 eg2=w2:expert_groups=True
ab issue-a fwd exact 7 eg2=w2:expert_groups=True
