#!/usr/bin/env bash
# call 6 (one H200, after call 5 found the launch over its thread limit): the warp-specialised Gluon WGRAD (partial steps zeroed by their own
# warps, no branch in the MMA loop): its GPU tests against the reference and the main
# kernel's bits, then the kernel alone against main, alternating in one process.
set -u
out=/tmp/o6; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py -k gluon_wgrad \
  > $out/t_wgrad.log 2>&1; echo "wgrad tests rc=$?"; tail -n 3 $out/t_wgrad.log
timeout 240 python3 docs/perf/2026-11-30-h200-run39/wgrad_ws_micro.py > $out/ws_micro.txt 2>&1
echo "ws micro rc=$?"; cat $out/ws_micro.txt | tail -n 12
tar czf /tmp/g6.tgz -C $out . && cp /tmp/g6.tgz $OUT/
