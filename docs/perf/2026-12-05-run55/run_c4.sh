#!/usr/bin/env bash
# run 55, call 4 (one H100; as run, one command line): Nsight Compute's full set on the wide
# and plain WGRADs (E=64, 128 rows per expert), then the probe at 64, 96 and 192 rows per
# expert (its stdout: c4/probe_rows.txt)
export PYTHONPATH=src; d=docs/perf/2026-12-05-run55
for cfg in wide plain; do
  timeout 200 ncu --clock-control none -k regex:_gluon_wgrad --launch-skip 1 --launch-count 1 \
    --set full --import-source no python3 $d/wgrad_probe.py --experts 64 --config $cfg \
    --kernel w13 > $OUT/ncu_full_$cfg.log 2>&1
  echo "ncu $cfg rc=$? at $SECONDS s"
done
for r in 64 96 192; do
  python3 $d/wgrad_probe.py --time --rows $r --kernel w13 --config plain wide pp 2>&1 | tail -4
done
