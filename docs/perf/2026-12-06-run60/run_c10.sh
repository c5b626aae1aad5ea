#!/usr/bin/env bash
# run 60, call 10 (one H100, main after the merge): the W2 DGRAD's expert-group order below
# its new range (DeepSeek-V4-Flash, 96 rows per expert, in lockstep) and at Qwen3-30B-A3B
# (256), Nsight Compute as in call 3; then the fwd+bwd bench under exact routing at the
# shapes whose picks changed in section 4 (issue-b, fine, olmoe).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
here=$(dirname "$0")/../2026-12-06-run58
M=gpu__time_duration.sum,dram__bytes_read.sum
for s in deepseek-v4-flash qwen3-30b-a3b; do
  for eg in False True; do
    timeout 120 ncu --clock-control none -k regex:_gluon_w2_dgrad --launch-skip 2 \
      --launch-count 1 --metrics $M python3 $here/ncu_layer_variant.py $s fwdbwd sampled \
      w2_dgrad:expert_groups=$eg > $OUT/ncu_${s}_eg$eg.log 2>&1
    echo "ncu $s eg=$eg rc=$? at $((SECONDS - t0)) s"
    grep -E "^  [_a-z]|gpu__time|dram__" $OUT/ncu_${s}_eg$eg.log | sed -E 's/ +/ /g' | cut -c1-70
  done
done
left=$((D - (SECONDS - t0)))
[ $left -gt 60 ] && timeout $left python3 -m distmoe bench --mode fwdbwd \
  --shapes issue-b fine olmoe --routing exact --providers distmoe torch --no-plots \
  --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch)" $OUT/bench.log | cut -c1-140
