#!/usr/bin/env bash
# run 57, call 1: where the W13 forward's warps wait. Run 56 call 10 found TMA alone streams
# DeepSeek-V3's W13 weights in the forward's order as fast as in the DGRAD's (3.2 TB/s), yet
# the forward reads DRAM at 79% of peak against the DGRAD's 87.5%. Nsight Compute's
# per-instruction stall samples (third eager fwd+bwd step, exact routing) of the W13 forward
# and the W13 DGRAD: which barrier waits (the consumers' "ready" or the producer's "empty")
# and on what. On an H200, first runs 54-55's WGRAD picks there (run 56's run_c4.sh).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
if [[ $name == *H200* ]]; then
  OUT=$OUT DEADLINE=320 bash docs/perf/2026-12-06-run56/run_c4.sh
fi
K='--kernel-name regex:_gluon_w13_kernel|_w13_dgrad_scatter --launch-skip 4 --launch-count 2'
S='--section WarpStateStats --section SchedulerStats --section SourceCounters --section LaunchStats'
timeout 230 ncu --clock-control none $K $S --import-source no -f -o $OUT/w13 \
  python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py deepseek-v3 fwdbwd exact 3 \
  > $OUT/ncu.log 2>&1
echo "ncu rc=$? at $((SECONDS - t0)) s"; tail -n 3 $OUT/ncu.log
ncu --import $OUT/w13.ncu-rep --print-details all > $OUT/details.txt 2>&1
ncu --import $OUT/w13.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>&1
echo "import at $((SECONDS - t0)) s"; wc -c $OUT/details.txt $OUT/sass.csv
grep -E "_kernel|_scatter|Duration|Stall|stall|Warp Cycles|Issued" $OUT/details.txt | cut -c1-150 | head -60
