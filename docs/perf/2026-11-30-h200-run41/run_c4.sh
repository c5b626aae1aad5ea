#!/usr/bin/env bash
# call 4 (one H200): the W2 DGRAD's score loads: production scored and plain, and
# w2d_diag.py variant 10 (scores from a contiguous array) against variant 0, fine and olmoe.
set -u
out=/tmp/o4; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
VARS=0,10,1 timeout 300 python3 docs/perf/2026-11-30-h200-run41/w2d_micro.py fine olmoe issue-b > $out/micro.txt 2>&1
echo "micro rc=$?"; grep -v Warn $out/micro.txt | tail -n 12
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
