#!/usr/bin/env bash
# Run 61 call 5: the W2 DGRAD's expert-group order below 96 rows per expert under Nsight
# Compute (DeepSeek-V3 at T=1024: 32 rows; GPT-OSS-120B at T=2048 and OLMoE at T=512: 64)
# and at the layer at GPT-OSS-120B's 64 rows.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"
ab gpt-oss-120b@2048 fwdbwd sampled 11 dgeg=w2_dgrad:expert_groups=True
M=gpu__time_duration.sum,dram__bytes_read.sum
ncu_py=$(dirname "$0")/../2026-12-06-run58/ncu_layer_variant.py
for s in deepseek-v3@1024 gpt-oss-120b@2048 olmoe@512; do
for eg in False True; do
  [ $((SECONDS - t0)) -gt $((D - 40)) ] && break
  timeout 100 ncu --clock-control none -k regex:_gluon_w2_dgrad --launch-skip 2 \
    --launch-count 1 --metrics $M python3 $ncu_py \
    $s fwdbwd sampled w2_dgrad:expert_groups=$eg > $OUT/ncu_w2dg_${s/@/_t}_eg$eg.log 2>&1
  echo "ncu W2 DGRAD $s eg=$eg rc=$?"
  grep -E "^  [_a-z]|gpu__time|dram__" $OUT/ncu_w2dg_${s/@/_t}_eg$eg.log | sed -E 's/ +/ /g' | cut -c1-70
done; done
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
