#!/usr/bin/env bash
# run 58, call 5 (any Hopper GPU): group-M 2 for the W13 forward's cooperative tile where its
# producers run in lockstep (128-191 rows per expert). Call 4 read it 1.018x / 1.006x at
# DeepSeek-V3 inference forward (exact / sampled, 9 rounds) and 1.022x at GPT-OSS-120B
# (sampled), even at issue-a and fine; here more rounds at the lockstep shapes, and the
# training forward in fwd+bwd. x > 1 on g2's line: faster. Set DEADLINE (s).
source "$(dirname "$0")/ab.sh"  # the environment, t0, D, the GPU's name, ab()
ab deepseek-v3 fwd sampled 15 g2=w13:inference:group_m=2
ab deepseek-v3 fwd exact 15 g2=w13:inference:group_m=2
ab gpt-oss-120b fwd exact 15 g2=w13:inference:group_m=2
ab gpt-oss-120b fwd sampled 15 g2=w13:inference:group_m=2
ab deepseek-v3 fwdbwd sampled 9 g2=w13:training:group_m=2
ab gpt-oss-120b fwdbwd sampled 9 g2=w13:training:group_m=2
