#!/usr/bin/env bash
# For the session after run 60 (any Hopper GPU, `DEADLINE=590 bash ...`, up to 10 minutes;
# not run yet; on an H200 it is also the expert-group orders' first reading there): the
# layer against the picks before runs 59-60 (`old`: every expert-group order off but the
# W13 forward's; x < 1 on old's line: the new picks faster) at DeepSeek-V4-Flash (the W2
# DGRAD's order at 96 rows per expert, measured on the kernel only), DeepSeek-V3 (fwd+bwd
# and inference forward), fine and issue-b; then the fwd+bwd bench under exact routing at
# DeepSeek-V3 and issue-a (run 60 benched the others).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
OLD=old=w2:expert_groups=False+w2_dgrad:expert_groups=False+w13_dgrad:expert_groups=False
ab deepseek-v4-flash fwdbwd sampled 9 $OLD
ab deepseek-v3 fwdbwd sampled 9 $OLD
ab deepseek-v3 fwd sampled 9 old=w2:expert_groups=False
ab fine fwdbwd sampled 9 $OLD
ab issue-b fwdbwd sampled 9 $OLD
left=$((D - (SECONDS - t0)))
[ $left -gt 100 ] && timeout $left python3 -m distmoe bench --mode fwdbwd \
  --shapes deepseek-v3 issue-a --routing exact --providers distmoe torch --no-plots \
  --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch)" $OUT/bench.log | cut -c1-140
