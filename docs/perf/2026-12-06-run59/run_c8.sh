#!/usr/bin/env bash
# run 59, call 8 (one H100): the W2 forward's DRAM bytes in the inference layer (third eager
# step, Nsight Compute) with the expert-group order and without, at DeepSeek-V3 and fine.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
r58=docs/perf/2026-12-06-run58
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum
for c in "deepseek-v3 True" "deepseek-v3 False" "fine True" "fine False"; do
  set -- $c
  [ $((SECONDS - t0)) -gt ${DEADLINE:-200} ] && break
  timeout 60 ncu --clock-control none -k regex:_gluon_w2_kernel --launch-skip 2 \
    --launch-count 1 --metrics $M python3 $r58/ncu_layer_variant.py $1 fwd sampled \
    w2:expert_groups=$2 > $OUT/ncu_$1_eg$2.log 2>&1
  echo "ncu $1 expert_groups=$2 rc=$? at $((SECONDS - t0)) s"
  grep -E "gpu__time|dram__|lts__" $OUT/ncu_$1_eg$2.log | sed -E 's/ +/ /g' | cut -c1-100
done
