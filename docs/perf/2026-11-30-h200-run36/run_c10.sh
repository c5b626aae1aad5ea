#!/usr/bin/env bash
# call 10 (one H200): after the last review: the fused kernel tests, two of them with the
# run-time hand-out again (their entries had followed FusedConfig's default, which became
# static after call 6)
set -u
out=/tmp/o10; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_w2_beside.py -k fused > $out/t_kernels.log 2>&1
echo "kernels rc=$?"; tail -2 $out/t_kernels.log
tar czf /tmp/g10.tgz -C $out . && cp /tmp/g10.tgz $OUT/
