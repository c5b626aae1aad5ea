#!/usr/bin/env bash
# call 5 (one H200): the backward's W2 WGRAD + W13 WGRAD beside the W13 DGRAD on a second
# stream, SMs split between them, against the sequence (bwd_streams_micro.py).
set -u
out=/tmp/o5; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 400 python3 docs/perf/2026-11-30-h200-run41/bwd_streams_micro.py fine olmoe issue-b > $out/micro.txt 2>&1
echo "micro rc=$?"; grep -v Warn $out/micro.txt | tail -n 12
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
