#!/usr/bin/env bash
# call 8 (x2): after the review (one W2 scatter epilogue shared by the W2 and fused
# kernels, one beside rule in the layer): the Gluon W2 and counter kernel tests, the fused
# and beside layer tests on two GPUs
set -u
out=/tmp/o8; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_w2_beside.py tests/kernels/test_forward_kernels.py -k "w2 or fused or done or wait" > $out/t_kernels.log 2>&1
echo "kernels rc=$?"; tail -2 $out/t_kernels.log
timeout 200 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py -k "fused or beside" > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -2 $out/t_multi.log
tar czf /tmp/g8.tgz -C $out . && cp /tmp/g8.tgz $OUT/
