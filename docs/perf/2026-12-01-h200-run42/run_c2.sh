#!/usr/bin/env bash
# run 42, call 2 (the same warm H200): call 1's micro-benchmark again after fixing its
# keep-alive (call 1 freed each shape's tensors while their graphs still addressed them: the
# illegal address there was the script's, the kernels had run and checked out before it)
export PYTHONPATH=src
timeout 80 python3 docs/perf/2026-12-01-h200-run42/w2d_prefetch_micro.py \
  fine:prod=4/0,p2=4/2,p3=3/3,p1=5/1 olmoe:prod=4/0,p2=4/2 2>&1 | grep -v "built and run" | tail -8
