#!/usr/bin/env bash
# call 7 (x2): the GPU tests this run touches (the counter kernels, the layer on two GPUs,
# the forward with ranks sharing a GPU), then the fused layer's default (ping-pong, lag 3,
# static) against main at fine (31 rounds) and issue-a (11 rounds), with the EP=1 share
set -u
out=/tmp/o7; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_w2_beside.py > $out/t_kernels.log 2>&1
echo "kernels rc=$?"; tail -2 $out/t_kernels.log
timeout 240 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py tests/runtime/test_heap.py > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -2 $out/t_multi.log
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q tests/ops/test_forward_gpu.py > $out/t_fwd.log 2>&1
echo "forward gpu rc=$?"; tail -2 $out/t_fwd.log
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
timeout 150 $R --shape fine --rounds 31 --variant fused=layer:fused=True > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -4
timeout 200 $R --shape issue-a --rounds 11 --variant fused=layer:fused=True --variant coop3=layer:fused=True+layer:fused_pp=False > $out/ab_issuea.log 2>&1
echo "ab issue-a rc=$?"; grep -v "^\*\|OMP" $out/ab_issuea.log | tail -5
tar czf /tmp/g7.tgz -C $out . && cp /tmp/g7.tgz $OUT/
