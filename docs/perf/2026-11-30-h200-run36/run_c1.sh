#!/usr/bin/env bash
# call 1 (x2): the fused W13 + W2 kernel: kernel tests (GPU 0), the layer on two GPUs, then
# a first A/B at fine against main (W13 then W2) with the EP=1 share
set -u
out=/tmp/o1; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -x -m gpu tests/kernels/test_w2_beside.py -k "fused" > $out/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; tail -4 $out/kernel_tests.log
timeout 200 python3 -m pytest -q -x -m multigpu tests/ops/test_multigpu.py -k fused > $out/layer_tests.log 2>&1
echo "layer tests rc=$?"; tail -4 $out/layer_tests.log
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
timeout 200 $R --shape fine --rounds 21 --variant fused=layer:fused=True --variant lag1=layer:fused=True+layer:fused_lag=1 --variant pp=layer:fused=True+layer:fused_pp=True > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -8
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
