#!/usr/bin/env bash
# run 45, call 3 (one H200): where the cooperative Gluon W13 forward (training: h1 and the
# gathered rows saved) waits, instruction by instruction (Nsight Compute's warp-stall sampling
# per SASS line), at fine (fwd+bwd, exact routing, third step), and its throughput sections
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o3; mkdir -p $out
t0=$SECONDS
K='--kernel-name regex:_gluon_w13_kernel --launch-skip 2 --launch-count 1'
L="python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py fine fwdbwd exact 3"
timeout 220 ncu $K --section SourceCounters --section WarpStateStats --import-source no \
  --page source --print-source sass --csv $L > $out/sass.csv 2> $out/sass.err
echo "ncu source rc=$? at $((SECONDS - t0)) s"; tail -n 2 $out/sass.err; wc -l $out/sass.csv
timeout 200 ncu $K --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section LaunchStats --section Occupancy $L > $out/details.txt 2> $out/details.err
echo "ncu details rc=$? at $((SECONDS - t0)) s"
grep -iE "Duration|Throughput|Busy|Stall|Warp Cycles|DRAM|L2|Registers|Shared Memory" $out/details.txt | head -40
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
