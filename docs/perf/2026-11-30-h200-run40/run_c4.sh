#!/usr/bin/env bash
# call 4 (one H200): the Gluon W13 whose producer loads the per-expert bounds per tile above
# 128 experts. GPU tests of the Gluon W13 (with the new 200-expert test), then the kernel
# alone at deepseek-v3 (sampled counts), this code (src) against 3490e8e's (scratch/old/src,
# carried), alternating processes, with h2 checksums.
set -u
out=/tmp/o4; mkdir -p $out
export PYTHONUNBUFFERED=1
git log -1 --format=%H > $out/commit.txt; git status --short >> $out/commit.txt
PYTHONPATH=src timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_forward_kernels.py \
  -k "w13_gluon" > $out/t_w13g.log 2>&1; echo "w13 gluon tests rc=$?"; tail -n 1 $out/t_w13g.log
for i in 1 2 3; do
  PYTHONPATH=src timeout 60 python3 docs/perf/2026-11-30-h200-run40/w13g_micro.py new 2>&1 | grep -v Warn | tee -a $out/micro.txt
  PYTHONPATH=scratch/old/src timeout 60 python3 docs/perf/2026-11-30-h200-run40/w13g_micro.py old 2>&1 | grep -v Warn | tee -a $out/micro.txt
done
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
