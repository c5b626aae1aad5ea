#!/usr/bin/env bash
# call 7 (one H200): tune_combine interleaved; W2 DGRAD Gluon GPU tests after the consumer cleanup
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py -k gluon_w2_dgrad > $out/t_dgrad.log 2>&1
echo "dgrad tests rc=$?"; tail -2 $out/t_dgrad.log
timeout 300 python3 tools/tune_combine.py --shapes fine issue-a deepseek-v3 --csv $out/combine.csv > $out/tune_combine.log 2>&1
echo "tune rc=$?"; tail -30 $out/tune_combine.log
tar czf /tmp/g7.tgz -C $out . && cp /tmp/g7.tgz $OUT/
