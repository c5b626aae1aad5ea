#!/usr/bin/env bash
# run 60, call 3 (one H100, branch wip/w2-dgrad-expert-groups): call 2's layer A/B read the
# W2 DGRAD's expert-group order 1.004-1.014x at 128-512 rows per expert and 0.969x at issue-a
# (2048, exact, rounds 15.8-18.0 ms wide). Nsight Compute on the W2 DGRAD kernels in the
# fwd+bwd layer's third eager step, order off and on: does the order read fewer DRAM bytes
# and take less time, as it does on the W2 forward (run 59)? Then the W2 forward's order in
# training at gpt-oss-120b and olmoe (call 1 read 1.011x at deepseek-v3 in 11 rounds).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
here=$(dirname "$0")/../2026-12-06-run58
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
for c in "deepseek-v3 sampled" "olmoe sampled" "issue-a exact"; do
  for eg in False True; do
    set -- $c
    [ $((SECONDS - t0)) -gt $((D - 60)) ] && break 2
    timeout 150 ncu --clock-control none -k regex:_gluon_w2_dgrad --launch-skip 2 \
      --launch-count 1 --metrics $M python3 $here/ncu_layer_variant.py $1 fwdbwd $2 \
      w2_dgrad:expert_groups=$eg > $OUT/ncu_$1_$2_eg$eg.log 2>&1
    echo "ncu $1 $2 eg=$eg rc=$? at $((SECONDS - t0)) s"
    grep -E "_gluon_w2_dgrad|gpu__time|dram__" $OUT/ncu_$1_$2_eg$eg.log | sed -E 's/ +/ /g' | cut -c1-100
  done
done
ab gpt-oss-120b fwdbwd sampled 9 eg2=w2:expert_groups=True
ab olmoe fwdbwd sampled 9 eg2=w2:expert_groups=True
