#!/usr/bin/env bash
# call (x2): W2 beside W13: kernel tests (GPU 0), A/B fine + issue-a, layer tests on two GPUs
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv >> $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -x -q -m gpu tests/kernels/test_w2_beside.py > $out/t_kernels.log 2>&1
echo "kernels rc=$?"; tail -4 $out/t_kernels.log
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
timeout 150 $R --shape fine --rounds 21 --variant seq=layer:w2_beside=False --variant b36=layer:w2_beside_sms=36 --variant b52=layer:w2_beside_sms=52 > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -7
timeout 150 $R --shape issue-a --rounds 7 --variant seq=layer:w2_beside=False --variant unphased=layer:w13_phases=False > $out/ab_issuea.log 2>&1
echo "ab issue-a rc=$?"; grep -v "^\*\|OMP" $out/ab_issuea.log | tail -5
timeout 200 python3 -m pytest -x -q -m multigpu tests/ops/test_multigpu.py -k beside > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -3 $out/t_multi.log
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
