#!/usr/bin/env bash
# run 59, call 6 (any Hopper GPU): the W2 forward's expert-group order at 512 rows per
# expert (inference), and the W13 DGRAD's at other fwd+bwd shapes (call 3: fine 1.043x,
# call 5: DeepSeek-V3 0.996x). x > 1 on a variant's line: faster.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
ab olmoe fwd sampled 9 eg2=w2:expert_groups=True
ab gpt-oss-20b fwd sampled 7 eg2=w2:expert_groups=True
ab fine fwdbwd sampled 9 egd=w13_dgrad:expert_groups=True
ab olmoe fwdbwd sampled 7 egd=w13_dgrad:expert_groups=True
ab gpt-oss-120b fwdbwd sampled 7 egd=w13_dgrad:expert_groups=True
ab issue-a fwdbwd exact 5 egd=w13_dgrad:expert_groups=True
