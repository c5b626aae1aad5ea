#!/usr/bin/env bash
# run 51, call 3: the training W13 forward alone at deepseek-v3 over its tile order (call 2's
# Nsight Compute: 21.4 GB read from DRAM for 15.0 GB of weights, L2 hit rate 17%: the
# gathered rows read again per column tile), timed interleaved and then its DRAM bytes per
# config, exact and random routing
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
D=docs/perf/2026-12-05-h200-run51
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for r in exact random; do
  timeout 150 python3 $D/w13_l2.py time $r > $OUT/time_$r.log 2>&1
  echo "time $r rc=$? at $((SECONDS - t0)) s"; tail -n 11 $OUT/time_$r.log | cut -c1-150
done
for r in exact random; do
  left=$((560 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left ncu --clock-control none --kernel-name regex:_gluon_w13_kernel --launch-skip 8 \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum,lts__t_sector_hit_rate.pct \
    python3 $D/w13_l2.py ncu $r > $OUT/ncu_$r.txt 2>&1
  echo "ncu $r rc=$? at $((SECONDS - t0)) s"
  grep -E "^launch|dram__bytes|gpu__time|hit_rate" $OUT/ncu_$r.txt | cut -c1-110
done
