#!/usr/bin/env bash
# run 44, call 1 (one H200): GPU tests of the Gluon W13 DGRAD, then the kernel alone
set -u
export PYTHONPATH=src
D=$OUT/c1; mkdir -p $D
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $D/gpu.txt
timeout 330 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py \
  -k "gluon_w13_dgrad or w13_dgrad_pair_tails_gpu" -p no:cacheprovider > $D/tests.log 2>&1
echo "pytest rc $?" >> $D/tests.log
tail -5 $D/tests.log
M=docs/perf/2026-12-01-h200-run44/w13d_micro.py
timeout 120 python3 $M --routing exact fine issue-a olmoe > $D/micro_exact.log 2>&1
timeout 120 python3 $M --routing sampled fine deepseek-v3 issue-b > $D/micro_sampled.log 2>&1
grep -v "built and run" $D/micro_*.log
