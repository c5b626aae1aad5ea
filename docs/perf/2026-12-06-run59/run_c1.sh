#!/usr/bin/env bash
# run 59, call 1 (any Hopper GPU): the GPU tests of run 58's expert-group order after its
# tile lookup was folded into one (run 58's run_c15.sh, not run then), then the W13
# forward's DRAM bytes in DeepSeek-V3's inference layer (third eager step, Nsight Compute)
# with the expert-group order (the heuristic's pick there now) and without it: run 58
# section 4 read 16.34 GB with the row-block order against 15.12 GB with L2-resident rows.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
r58=docs/perf/2026-12-06-run58
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_forward_kernels.py -k "expert_groups or w13_gluon_lockstep" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/tests.log
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum
for c in "sampled True" "sampled False" "exact True" "exact False"; do
  set -- $c
  [ $((SECONDS - t0)) -gt ${DEADLINE:-420} ] && break
  timeout 120 ncu --clock-control none -k regex:_gluon_w13_kernel --launch-skip 2 \
    --launch-count 1 --metrics $M python3 $r58/ncu_layer_variant.py deepseek-v3 fwd $1 \
    w13:inference:expert_groups=$2 > $OUT/ncu_$1_eg$2.log 2>&1
  echo "ncu $1 expert_groups=$2 rc=$? at $((SECONDS - t0)) s"
  grep -E "gpu__time|dram__|lts__" $OUT/ncu_$1_eg$2.log | sed -E 's/ +/ /g' | cut -c1-100
done
