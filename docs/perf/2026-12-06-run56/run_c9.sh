#!/usr/bin/env bash
# run 56, call 9 (one H100): what the four weight-reading GEMMs of deepseek-v3's fwd+bwd step
# read from DRAM and at what rate (Nsight Compute, third eager step, both routings): the
# W13 forward, W13 DGRAD, W2 forward and W2 DGRAD run at 76-82% of the read-only ceiling
# in call 6's profile
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
K='--kernel-name regex:_gluon_w13_kernel|_w13_dgrad_scatter|_gluon_w2_kernel|_gluon_w2_dgrad_split --launch-skip 8 --launch-count 4'
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,sm__cycles_elapsed.avg.per_second
for r in exact sampled; do
  timeout 250 ncu --clock-control none $K --metrics $M \
    python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py deepseek-v3 fwdbwd $r 3 \
    > $OUT/ncu_$r.txt 2> $OUT/ncu_$r.err
  echo "ncu $r rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/ncu_$r.err
  grep -E "^  _|_kernel|gpu__time|dram__|lts__|sm__cycles" $OUT/ncu_$r.txt | sed -E 's/ +/ /g' | cut -c1-120
done
