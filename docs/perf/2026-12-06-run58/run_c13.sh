#!/usr/bin/env bash
# run 58, call 13 (one H100): the W13 forward's DRAM bytes in the layer (DeepSeek-V3 inference
# forward, third eager step) with group-M 8 (the heuristic), 2 and 1, sampled and exact
# routing: section 3's layer A/B read group-M 1 0.974x sampled but 1.021x exact; does the
# sampled case read more weights or rows again?
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
here=$(dirname "$0")
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum
for c in "sampled 8" "sampled 2" "sampled 1" "exact 8" "exact 1"; do
  set -- $c
  [ $((SECONDS - t0)) -gt ${DEADLINE:-400} ] && break
  timeout 120 ncu --clock-control none -k regex:_gluon_w13_kernel --launch-skip 2 \
    --launch-count 1 --metrics $M python3 $here/ncu_layer_variant.py deepseek-v3 fwd $1 \
    w13:inference:group_m=$2 > $OUT/ncu_$1_g$2.log 2>&1
  echo "ncu $1 group-M $2 rc=$? at $((SECONDS - t0)) s"
  grep -E "gpu__time|dram__|lts__" $OUT/ncu_$1_g$2.log | sed -E 's/ +/ /g' | cut -c1-100
done
