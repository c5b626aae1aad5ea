#!/usr/bin/env bash
# run 55, call 2: why the warp-specialised WGRADs lose to the plain persistent kernel at
# exactly 128 rows per expert (DeepSeek-V3, D=7168 F=2048): timing of four configs at E=256
# (do_bench), then Nsight Compute on one launch each at E=64 (same tiles per expert)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
d=docs/perf/2026-12-05-run55
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 150 python3 $d/wgrad_probe.py --time > $OUT/probe_time.log 2>&1
echo "timing rc=$? at $((SECONDS - t0)) s"; cat $OUT/probe_time.log | tail -n 10
timeout 100 python3 $d/wgrad_probe.py --time --rows 256 --kernel w13 > $OUT/probe_time256.log 2>&1
echo "timing 256 rows rc=$? at $((SECONDS - t0)) s"; tail -n 6 $OUT/probe_time256.log
for cfg in plain wide pp; do
  left=$((570 - (SECONDS - t0))); [ $left -lt 30 ] && break
  timeout $left ncu --clock-control none -k regex:_gluon_wgrad --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats \
    --section Occupancy --section SchedulerStats --section WarpStateStats \
    --metrics dram__bytes_write.sum,dram__bytes_read.sum,lts__t_bytes.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    python3 $d/wgrad_probe.py --experts 64 --config $cfg --kernel w13 > $OUT/ncu_$cfg.log 2>&1
  echo "ncu $cfg rc=$? at $((SECONDS - t0)) s"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|dram__bytes_write|hmma|Registers Per|Stall|Issued Warp|No Eligible|Active Warps" $OUT/ncu_$cfg.log | head -20
done
