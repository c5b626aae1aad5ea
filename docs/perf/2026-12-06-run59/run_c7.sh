#!/usr/bin/env bash
# run 59, call 7 (any Hopper GPU): where the W2 forward's expert-group order stops paying
# (calls 3 and 6: 1.02-1.04x at 128-512 rows per expert, 0.967x at 2048): 1024 rows per
# expert at two shapes, 128 at issue-b; the W13 DGRAD's at fine under exact routing.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
ab olmoe@8192 fwd sampled 7 eg2=w2:expert_groups=True
ab issue-a@4096 fwd sampled 7 eg2=w2:expert_groups=True
ab issue-b fwd sampled 9 eg2=w2:expert_groups=True
ab fine fwdbwd exact 7 egd=w13_dgrad:expert_groups=True
