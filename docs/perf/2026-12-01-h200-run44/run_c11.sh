#!/usr/bin/env bash
# run 44, call 11 (one H200): where the split W2 DGRAD's epilogue warps wait, instruction by
# instruction (Nsight Compute's warp-stall sampling per SASS line), at fine (fwd+bwd, exact
# routing, third step), for the next change to that epilogue
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o11; mkdir -p $out
t0=$SECONDS
K='--kernel-name regex:_gluon_w2_dgrad_split_kernel --launch-skip 2 --launch-count 1'
L="python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py fine fwdbwd exact 3"
timeout 200 ncu $K --section SourceCounters --section WarpStateStats --import-source no \
  --page source --print-source sass --csv $L > $out/sass.csv 2> $out/sass.err
echo "ncu source rc=$? at $((SECONDS - t0)) s"; tail -n 2 $out/sass.err; wc -l $out/sass.csv
timeout 150 ncu $K --section SourceCounters --section WarpStateStats $L > $out/details.txt 2> $out/details.err
echo "ncu details rc=$? at $((SECONDS - t0)) s"; grep -iE "stall|Duration|Warp Cycles" $out/details.txt | head -20
tar czf /tmp/g11.tgz -C $out . && cp /tmp/g11.tgz $OUT/
