#!/usr/bin/env bash
# For the session after run 60 (any Hopper GPU, `DEADLINE=590 bash ...`, up to 10 minutes;
# not run yet; on an H200 it is also the expert-group orders' first reading there): the
# layer against the picks before runs 59-60 (`old`: every expert-group order off but the
# W13 forward's; x < 1 on old's line: the new picks faster) at DeepSeek-V4-Flash (the W2
# DGRAD's order at 96 rows per expert, measured on the kernel only), DeepSeek-V3 (fwd+bwd
# and inference forward), fine and issue-b; then the fwd+bwd bench under exact routing at
# DeepSeek-V3 and issue-a (run 60 benched the others); last, Nsight Compute on the W13
# forward in DeepSeek-V3's fwd+bwd step with its expert-group order off and on (run 58 took it
# for inference only on an even layer A/B; the kernel in training is unmeasured). Every log
# comes back in one archive, logs.tgz (the device returns at most 8 files a call).
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
M=gpu__time_duration.sum,dram__bytes_read.sum
ncu_py=$(dirname "$0")/../2026-12-06-run58/ncu_layer_variant.py
for eg in False True; do
  [ $((SECONDS - t0)) -gt $((D - 40)) ] && break
  timeout 100 ncu --clock-control none -k regex:_gluon_w13_kernel --launch-skip 2 \
    --launch-count 1 --metrics $M python3 $ncu_py \
    deepseek-v3 fwdbwd sampled w13:training:expert_groups=$eg > $OUT/ncu_w13_eg$eg.log 2>&1
  echo "ncu W13 training eg=$eg rc=$?"
  grep -E "^  [_a-z]|gpu__time|dram__" $OUT/ncu_w13_eg$eg.log | sed -E 's/ +/ /g' | cut -c1-70
done
(cd $OUT && tar czf logs.tgz --remove-files -- *.log bench 2>/dev/null); ls $OUT
