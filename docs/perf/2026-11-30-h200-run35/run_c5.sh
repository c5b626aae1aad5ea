#!/usr/bin/env bash
# call (x2): GPU tests after the fixes: W2-beside kernels (GPU 0), forward GPU tests (GPU 0), all two-GPU tests
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_w2_beside.py > $out/t_kernels.log 2>&1
echo "kernels rc=$?"; tail -4 $out/t_kernels.log
timeout 250 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py tests/runtime/test_heap.py > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -3 $out/t_multi.log
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q tests/ops/test_forward_gpu.py > $out/t_fwd.log 2>&1
echo "forward gpu rc=$?"; tail -3 $out/t_fwd.log
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
