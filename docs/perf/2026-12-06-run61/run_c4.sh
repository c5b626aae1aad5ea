#!/usr/bin/env bash
# Run 61 call 4: the W2 DGRAD's expert-group order below its bound (64 rows per expert,
# DeepSeek-V3 at T=2048) at the layer and under Nsight Compute, and at its lower bound (96
# rows, DeepSeek-V4-Flash) at the layer with it turned off.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"
ab deepseek-v3@2048 fwdbwd sampled 11 dgeg=w2_dgrad:expert_groups=True
ab deepseek-v4-flash fwdbwd sampled 11 off=w2_dgrad:expert_groups=False
M=gpu__time_duration.sum,dram__bytes_read.sum
ncu_py=$(dirname "$0")/../2026-12-06-run58/ncu_layer_variant.py
for eg in False True; do
  [ $((SECONDS - t0)) -gt $((D - 40)) ] && break
  timeout 100 ncu --clock-control none -k regex:_gluon_w2_dgrad --launch-skip 2 \
    --launch-count 1 --metrics $M python3 $ncu_py \
    deepseek-v3@2048 fwdbwd sampled w2_dgrad:expert_groups=$eg > $OUT/ncu_w2dg_eg$eg.log 2>&1
  echo "ncu W2 DGRAD 64 rows eg=$eg rc=$?"
  grep -E "^  [_a-z]|gpu__time|dram__" $OUT/ncu_w2dg_eg$eg.log | sed -E 's/ +/ /g' | cut -c1-70
done
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
