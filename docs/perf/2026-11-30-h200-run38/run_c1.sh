#!/usr/bin/env bash
# call 1 (x2): the GPU suites on this session's code (the input buffer at EP = 1, 2, 4 with
# ranks sharing GPU 0 is new in test_forward_gpu.py), then target 5 at fine with x in the
# input buffer (41 rounds) and issue-a (11 rounds)
set -u
out=/tmp/o1; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 200 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py tests/runtime/test_heap.py > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -n 2 $out/t_multi.log
(CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m pytest -q tests/ops/test_forward_gpu.py > $out/t_fwd.log 2>&1; echo "forward gpu rc=$?" >> $out/t_fwd.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 230 python3 -m pytest -q tests/ops/test_training_gpu.py > $out/t_train.log 2>&1; echo "training gpu rc=$?" >> $out/t_train.log) &
wait
tail -n 2 $out/t_fwd.log $out/t_train.log
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share --variant inbuf=input:buffer=True"
timeout 150 $R --shape fine --rounds 41 > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -n 3
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
