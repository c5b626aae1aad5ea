#!/usr/bin/env bash
# Run 61 call 7 (asked for an H200, got an H100; `DEADLINE=400`, 148 s): the layer
# with run 61's picks against run 60's (`old`: x < 1 on old's line: run 61's picks faster):
# the W13 forward's order in training at DeepSeek-V3 and GPT-OSS-120B (128 rows per expert),
# the W2 DGRAD's at 64 rows per expert (DeepSeek-V3 at T=2048); then the W13 forward's order
# forced on in training at 192 rows per expert (T=3072 D=2048 F=768 E=128 K=8, past the lockstep
# range) and the fwd+bwd bench, sampled, at the two lockstep shapes. Logs in logs.tgz.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
ab deepseek-v3 fwdbwd sampled 11 old=w13:training:expert_groups=False
ab gpt-oss-120b fwdbwd sampled 11 old=w13:training:expert_groups=False
ab deepseek-v3@2048 fwdbwd sampled 11 old=w2_dgrad:expert_groups=False
ab fine@3072 fwdbwd sampled 9 eg=w13:training:expert_groups=True
left=$((D - (SECONDS - t0)))
[ $left -gt 80 ] && timeout $left python3 -m distmoe bench --mode fwdbwd \
  --shapes deepseek-v3 gpt-oss-120b --routing sampled --providers distmoe torch --no-plots \
  --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch)" $OUT/bench.log | cut -c1-140
(cd $OUT && tar czf logs.tgz --remove-files -- *.log bench 2>/dev/null); ls $OUT
