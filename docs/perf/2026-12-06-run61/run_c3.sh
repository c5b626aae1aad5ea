#!/usr/bin/env bash
# Run 61 call 3: the W13 forward's expert-group order in training (lockstep rows, 128-191
# per expert) repeated with more rounds and under exact routing; then the W2 forward's and
# W2 DGRAD's orders below their bounds (64 rows per expert: DeepSeek-V3 at T=2048).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"
NEW=new=w13:training:expert_groups=True
ab deepseek-v3 fwdbwd sampled 15 $NEW
ab gpt-oss-120b fwdbwd sampled 15 $NEW
ab deepseek-v3 fwdbwd exact 9 $NEW
ab gpt-oss-120b fwdbwd exact 9 $NEW
ab deepseek-v3@2048 fwd sampled 11 w2eg=w2:expert_groups=True
ab deepseek-v3@2048 fwdbwd sampled 11 w2eg=w2:expert_groups=True dgeg=w2_dgrad:expert_groups=True
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
