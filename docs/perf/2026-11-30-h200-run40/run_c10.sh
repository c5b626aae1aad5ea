#!/usr/bin/env bash
# call 10 (one H200): is Nsight Compute there; if so, the W13 DGRAD (main's tiles and the
# pair_tails form) at fine and deepseek-v3, exact and sampled counts: time, DRAM bytes, L2
# hit rate, SM and tensor-pipe activity.
set -u
out=/tmp/o10; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
(which ncu nsys; ls /usr/local/cuda*/bin 2>/dev/null | grep -E "ncu|nsys"; ncu --version) > $out/tools.txt 2>&1
cat $out/tools.txt | head -8
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg,smsp__warps_active.avg.pct_of_peak_sustained_active
timeout 400 ncu --kernel-name regex:_w13_dgrad --metrics $M --csv \
  python3 docs/perf/2026-11-30-h200-run40/w13d_ncu.py pair=pair_tails=True \
  > $out/ncu.csv 2> $out/ncu.err
echo "ncu rc=$?"; tail -n 3 $out/ncu.err; wc -l $out/ncu.csv
tar czf /tmp/g10.tgz -C $out . && cp /tmp/g10.tgz $OUT/
