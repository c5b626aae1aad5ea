#!/usr/bin/env bash
# run 51, call 4: the training W13 forward at deepseek-v3 with its producers in lockstep
# (W13Config.lockstep; call 3: under random routing the kernel reads 21.8-24.4 GB from DRAM
# against 15.5-16.2 under exact routing, the same configs: the programs drift apart as tiles
# differ in live rows, and stop sharing weight tiles and row blocks in L2), bits checked
# against the heuristic's config, timed interleaved, DRAM bytes by Nsight Compute
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
D=docs/perf/2026-12-05-h200-run51
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for r in random exact; do
  timeout 150 python3 $D/w13_l2.py time $r --lockstep > $OUT/time_$r.log 2>&1
  echo "time $r rc=$? at $((SECONDS - t0)) s"; grep -E "same bits|Error|error" $OUT/time_$r.log | head -12; tail -n 10 $OUT/time_$r.log | grep -v "same bits" | cut -c1-150
done
left=$((560 - (SECONDS - t0)))
timeout $left ncu --clock-control none --kernel-name regex:_gluon_w13_kernel --launch-skip 8 \
  --metrics dram__bytes_read.sum,gpu__time_duration.sum,lts__t_sector_hit_rate.pct \
  python3 $D/w13_l2.py ncu random --lockstep > $OUT/ncu_random.txt 2>&1
echo "ncu random rc=$? at $((SECONDS - t0)) s"
grep -E "^launch|dram__bytes|gpu__time|hit_rate" $OUT/ncu_random.txt | cut -c1-110
