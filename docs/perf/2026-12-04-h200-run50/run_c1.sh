#!/usr/bin/env bash
# run 50, call 1 (one H200): why the two WGRADs take 9.2 of deepseek-v3's 22.6 ms step
# (run 49's profile): write / read bandwidth ceilings, the WGRAD kernels alone over their
# Gluon configs (tune_wgrad --quick, both routings), and Nsight Compute's throughput
# sections for both WGRAD launches of the third eager step (sampled routing)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
D=docs/perf/2026-12-04-h200-run50
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
python3 $D/bw_ceiling.py 2>&1 | tail -n 3
timeout 200 python3 tools/tune_wgrad.py --shapes deepseek-v3 --quick --routing random balanced \
  --csv $OUT/tune_wgrad.csv > $OUT/tune_wgrad.log 2>&1
echo "tune_wgrad rc=$? at $((SECONDS - t0)) s"; grep -vE "^\s*$" $OUT/tune_wgrad.log | tail -n 40 | cut -c1-150
K='--kernel-name regex:_gluon_wgrad_ws_kernel --launch-skip 4 --launch-count 2'
L="python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py deepseek-v3 fwdbwd sampled 3"
left=$((560 - (SECONDS - t0)))
timeout $left ncu --clock-control none $K --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section LaunchStats --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed \
  $L > $OUT/ncu_wgrad.txt 2> $OUT/ncu_wgrad.err
echo "ncu rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/ncu_wgrad.err
grep -iE "Duration|Throughput|Busy|dram__|lts__|gmma|Stall|Elapsed Cycles|SM Frequency|DRAM Freq|Registers" $OUT/ncu_wgrad.txt | head -60
