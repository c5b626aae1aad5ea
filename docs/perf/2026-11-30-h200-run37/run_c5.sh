#!/usr/bin/env bash
# call 5 (x2): deferred returns (every N-th peer route slot's result kept with its expert,
# read across NVLink by the owner's combine): the kernel tests (GPU 0) and the two-GPU
# tests, then A/Bs at fine (41 rounds) and issue-b (21) with the EP=1 share, and one-step
# timelines at fine
set -u
out=/tmp/o5; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q tests/kernels/test_defer_returns.py > $out/t_kernels.log 2>&1
echo "kernels rc=$?"; tail -n 2 $out/t_kernels.log
timeout 200 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py -k "deferred or input_buffer" > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -n 2 $out/t_multi.log
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share --variant inbuf=input:buffer=True"
B="input:buffer=True+layer:defer_every"
timeout 200 $R --shape fine --rounds 41 --variant d3=$B=3 --variant d4=$B=4 --variant d5=$B=5 --variant d6=$B=6 --variant d8=$B=8 > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -8
timeout 150 $R --shape issue-b --rounds 21 --variant d4=$B=4 --variant d5=$B=5 > $out/ab_issue-b.log 2>&1
echo "ab issue-b rc=$?"; grep -v "^\*\|OMP" $out/ab_issue-b.log | tail -5
P="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/profile_layer.py --shape fine --mode fwd --graph --steps 3 --set input:buffer=True"
timeout 100 $P --set layer:defer_every=5 --trace /tmp/tr_d > $out/prof_d.log 2>&1; echo "prof d rc=$?"
python3 tools/trace_timeline.py /tmp/tr_d.rank0 /tmp/tr_d.rank1 --steps 3 > $out/defer5_timeline.txt 2>&1
grep -E "w13|w2|combine|barrier|defer|Memcpy" $out/defer5_timeline.txt | head -16
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
