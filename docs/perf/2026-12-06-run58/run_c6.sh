#!/usr/bin/env bash
# run 58, call 6 (any Hopper GPU): group-M 2 for the inference W13's cooperative tile at the
# other lockstep shapes (128 rows per expert): issue-b (T=2048 D=2048 F=768 E=128 K=8),
# OLMoE at T=1024, issue-a at T=512, and DeepSeek-V3 sampled again (calls 4-5: 1.006x,
# 1.001x). x > 1 on g2's line: faster. Set DEADLINE (s).
source "$(dirname "$0")/ab.sh"  # the environment, t0, D, the GPU's name, ab()
ab issue-b fwd sampled 15 g2=w13:inference:group_m=2
ab issue-b fwd exact 15 g2=w13:inference:group_m=2
ab olmoe@1024 fwd sampled 15 g2=w13:inference:group_m=2
ab issue-a@512 fwd sampled 15 g2=w13:inference:group_m=2
ab deepseek-v3 fwd sampled 15 g2=w13:inference:group_m=2
ab gpt-oss-120b@2048 fwd sampled 15 g2=w13:inference:group_m=2
