#!/usr/bin/env bash
# Run 61 call 8 (asked for an H200, got an H100; `DEADLINE=330`, 144 s; on an H200 it would
# be the expert-group orders' first reading there, see run_next.sh): the layer
# against every order off but the W13 forward's inference one (`old`; x < 1 on old's line:
# the orders faster) at DeepSeek-V3 and fine, fwd+bwd; then the W2 forward's order forced
# on at DeepSeek-V4-Flash's 96 rows per expert (forward and fwd+bwd; the heuristic takes it
# from 128, run 61 read 64 rows even) and the fwd+bwd bench under sampled routing at the
# two shapes. Logs in logs.tgz.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
OLD=w2:expert_groups=False+w2_dgrad:expert_groups=False+w13_dgrad:expert_groups=False
ab deepseek-v3 fwdbwd sampled 9 old=$OLD+w13:training:expert_groups=False
ab fine fwdbwd sampled 9 old=$OLD
ab deepseek-v4-flash fwd sampled 11 eg=w2:expert_groups=True
ab deepseek-v4-flash fwdbwd sampled 9 eg=w2:expert_groups=True
left=$((D - (SECONDS - t0)))
[ $left -gt 80 ] && timeout $left python3 -m distmoe bench --mode fwdbwd \
  --shapes deepseek-v3 fine --routing sampled --providers distmoe torch --no-plots \
  --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch)" $OUT/bench.log | cut -c1-140
(cd $OUT && tar czf logs.tgz --remove-files -- *.log bench 2>/dev/null); ls $OUT
