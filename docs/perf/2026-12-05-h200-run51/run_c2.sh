#!/usr/bin/env bash
# run 51, call 2 (one H200: deepseek-v3's layer does not fit the H100's 80 GB, call 1): the
# ping-pong W13 training forward against the cooperative pick at the layer (run 50 call 2:
# 3% faster alone), then Nsight Compute on the two kernels furthest from their weight-traffic
# floor at deepseek-v3 (run 50: the W13 forward alone at 66% of the read-only ceiling, the W2
# DGRAD at 64%), third eager step, sampled routing
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
python3 docs/perf/2026-12-04-h200-run50/bw_ceiling.py 2>&1 | tail -n 3
for r in sampled exact; do
  timeout 200 python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd --routing $r \
    --rounds 7 --variant w13pp=w13:training:num_warps=4,num_stages=5 > $OUT/ab_w13pp_$r.log 2>&1
  echo "ab $r rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_w13pp_$r.log; tail -n 1 $OUT/ab_w13pp_$r.log | cut -c1-160
done
K='--kernel-name regex:_gluon_w13_kernel|_gluon_w2_dgrad --launch-skip 4 --launch-count 2'
L="python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py deepseek-v3 fwdbwd sampled 3"
left=$((570 - (SECONDS - t0)))
timeout $left ncu --clock-control none $K --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section LaunchStats --section Occupancy --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \
  $L > $OUT/ncu.txt 2> $OUT/ncu.err
echo "ncu rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/ncu.err
grep -iE "^  _gluon|Duration|Throughput|Busy|dram__|lts__|gmma|Stall|Elapsed Cycles|SM Frequency|Registers|Grid Size|Block Size" $OUT/ncu.txt | head -70
