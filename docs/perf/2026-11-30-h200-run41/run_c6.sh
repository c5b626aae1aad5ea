#!/usr/bin/env bash
# call 6 (one H200): the warp-specialised WGRAD with ping-pong warpgroups: GPU tests (the
# Gluon WGRAD, all forms), then the kernel alone against the heuristic's cooperative form.
set -u
out=/tmp/o6; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py -k gluon_wgrad > $out/t_wgrad.log 2>&1
echo "tests rc=$?"; tail -n 3 $out/t_wgrad.log
VARIANTS=pp timeout 300 python3 docs/perf/2026-11-30-h200-run41/wgrad_bk_micro.py > $out/micro.txt 2>&1
echo "micro rc=$?"; grep -v Warn $out/micro.txt | tail -n 20
tar czf /tmp/g6.tgz -C $out . && cp /tmp/g6.tgz $OUT/
