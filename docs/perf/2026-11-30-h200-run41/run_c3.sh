#!/usr/bin/env bash
# call 3 (one H200): the W2 DGRAD's epilogue taken apart (w2d_diag.py variants 0-3), kernel
# alone at fine and issue-a, exact counts.
set -u
out=/tmp/o3; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 300 python3 docs/perf/2026-11-30-h200-run41/w2d_micro.py fine issue-a > $out/micro.txt 2>&1
echo "micro rc=$?"; grep -v Warn $out/micro.txt | tail -n 12
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
