#!/usr/bin/env bash
# run 60, call 4 (one H100, branch wip/w2-dgrad-expert-groups): call 3's Nsight Compute read
# the W2 DGRAD's expert-group order faster at 128 and 512 rows per expert and 12% slower at
# 2048: where between does it turn? The W2 DGRAD at 128 (issue-b), 256 (fine), 512
# (gpt-oss-20b) and 1024 rows per expert (olmoe@8192 sampled, issue-a@4096 exact), order off
# and on; then the W2 forward in DeepSeek-V3's training step (skip 4, count 2: the W2 forward
# and the W13 DGRAD share the kernel; the variant changes the first only), off and on.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
here=$(dirname "$0")/../2026-12-06-run58
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
prof() {  # TAG KERNEL SKIP COUNT SHAPE ROUTING SPEC
  [ $((SECONDS - t0)) -gt $((D - 50)) ] && return
  timeout 150 ncu --clock-control none -k regex:$2 --launch-skip $3 --launch-count $4 \
    --metrics $M python3 $here/ncu_layer_variant.py $5 fwdbwd $6 $7 > $OUT/ncu_$1.log 2>&1
  echo "ncu $1 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +_gluon|gpu__time|dram__" $OUT/ncu_$1.log | sed -E 's/ +/ /g' | cut -c1-90
}
for c in "issue-b sampled" "fine sampled" "gpt-oss-20b sampled" "olmoe@8192 sampled" \
         "issue-a@4096 exact"; do
  set -- $c
  for eg in False True; do
    prof ${1/@/_t}_eg$eg _gluon_w2_dgrad 2 1 $1 $2 w2_dgrad:expert_groups=$eg
  done
done
for eg in False True; do
  prof w2fwd_deepseek-v3_eg$eg _gluon_w2_kernel 4 2 deepseek-v3 sampled w2:expert_groups=$eg
done
