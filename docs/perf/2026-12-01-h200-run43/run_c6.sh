#!/usr/bin/env bash
# run 43, call 6 (one H200): Nsight Compute on the split W2 DGRAD at fine (fwd+bwd, exact
# routing, third step): how close the MMA warpgroup now runs to the MMA-only time (run 41:
# 157 us) and where the epilogue warps stall; then the kernel alone at deepseek-v3.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o6; mkdir -p $out
t0=$SECONDS
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats"
X="--metrics dram__bytes_read.sum,dram__bytes_write.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
timeout 150 ncu --kernel-name regex:"_gluon_w2_dgrad_split_kernel" --launch-skip 2 --launch-count 1 $S $X \
  python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py fine fwdbwd exact 3 > $out/ncu_fine.txt 2> $out/ncu_fine.err
echo "ncu rc=$? at $((SECONDS - t0)) s"; tail -n 2 $out/ncu_fine.err
grep -E "Duration|DRAM Throughput|Compute \(SM\)|dram__bytes|hmma|No Eligible|Issued Warp|Eligible Warps|Active Warps|Registers|Warp Cycles Per Issued" $out/ncu_fine.txt | head -30
timeout 90 python3 docs/perf/2026-12-01-h200-run42/w2d_prefetch_micro.py \
  deepseek-v3:prod=4/0,e8=4/0/8/1 > $out/micro_dsv3.log 2>&1
echo "micro rc=$? at $((SECONDS - t0)) s"; grep -v "built and run" $out/micro_dsv3.log | tail -n 3
tar czf /tmp/g6.tgz -C $out . && cp /tmp/g6.tgz $OUT/
