#!/usr/bin/env bash
# call 4 (x2): the heap's barrier is no kernel on a one-rank group now: the GPU tests at
# EP = 1 and on two GPUs; a one-step timeline of the EP=1 share at fine; fine again (41
# rounds, x in the input buffer) and issue-a (11 rounds)
set -u
out=/tmp/o4; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 200 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py tests/runtime/test_heap.py > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -2 $out/t_multi.log
# one file per GPU, at the same time
(CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q tests/ops/test_forward_gpu.py > $out/t_fwd.log 2>&1; echo "forward gpu rc=$?" >> $out/t_fwd.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q tests/ops/test_training_gpu.py > $out/t_train.log 2>&1; echo "training gpu rc=$?" >> $out/t_train.log) &
wait
tail -n 2 $out/t_fwd.log $out/t_train.log
P="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/profile_layer.py --shape fine --mode fwd --graph --steps 3"
timeout 100 $P --ep1-share --trace /tmp/tr_s > $out/prof_share.log 2>&1; echo "prof share rc=$?"
python3 tools/trace_timeline.py /tmp/tr_s.rank0 /tmp/tr_s.rank1 --steps 3 > $out/share_timeline.txt 2>&1
head -20 $out/share_timeline.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share --variant inbuf=input:buffer=True"
timeout 150 $R --shape fine --rounds 41 > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -3
timeout 150 $R --shape issue-a --rounds 11 > $out/ab_issue-a.log 2>&1
echo "ab issue-a rc=$?"; grep -v "^\*\|OMP" $out/ab_issue-a.log | tail -3
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
