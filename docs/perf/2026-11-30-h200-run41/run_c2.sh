#!/usr/bin/env bash
# call 2 (one H200): Nsight Compute on the layer's GEMM kernels at fine (fwd+bwd, exact
# routing, third step: the six launches) and on the W2 DGRAD at issue-a: why the W2 DGRAD
# runs at about half the W2 forward's rate at fine though both read the same weights.
set -u
out=/tmp/o2; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats"
X="--metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,l1tex__t_bytes.sum,lts__t_bytes.sum"
timeout 240 ncu --kernel-name regex:"gluon_w13_kernel|gluon_w2_kernel|gluon_w2_dgrad|w13_dgrad_scatter|gluon_wgrad" \
  --launch-skip 12 --launch-count 6 $S $X \
  python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py fine fwdbwd exact 3 > $out/ncu_fine.txt 2> $out/ncu_fine.err
echo "ncu fine rc=$?"; tail -n 2 $out/ncu_fine.err
timeout 200 ncu --kernel-name regex:"gluon_w2_dgrad|gluon_w2_kernel" --launch-skip 4 --launch-count 2 $S $X \
  python3 docs/perf/2026-11-30-h200-run41/ncu_layer.py issue-a fwdbwd exact 3 > $out/ncu_issuea.txt 2> $out/ncu_issuea.err
echo "ncu issue-a rc=$?"; tail -n 2 $out/ncu_issuea.err
grep -E "^  [_a-z]|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|dram__bytes|lts__t_sector_hit|L2 Hit|No Eligible|Issued Warp" $out/ncu_fine.txt $out/ncu_issuea.txt | head -120
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
