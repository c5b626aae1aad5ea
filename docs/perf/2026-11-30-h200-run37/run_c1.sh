#!/usr/bin/env bash
# call 1 (x2): x written into the context's input buffer (no copy of x before the publish
# barrier): its two-GPU test, then A/Bs against main at fine (31 rounds, also with the fused
# kernel) and issue-a (11 rounds) with the EP=1 share, and one-step timelines at fine
set -u
out=/tmp/o1; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 150 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py -k input_buffer > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -2 $out/t_multi.log
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
timeout 170 $R --shape fine --rounds 31 --variant inbuf=input:buffer=True --variant inbuf_fused=input:buffer=True+layer:fused=True --variant fused=layer:fused=True > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -6
timeout 170 $R --shape issue-a --rounds 11 --variant inbuf=input:buffer=True > $out/ab_issuea.log 2>&1
echo "ab issue-a rc=$?"; grep -v "^\*\|OMP" $out/ab_issuea.log | tail -4
P="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/profile_layer.py --shape fine --mode fwd --graph --steps 3"
timeout 100 $P --trace /tmp/tr_b --set input:buffer=True > $out/prof_b.log 2>&1; echo "prof b rc=$?"
python3 tools/trace_timeline.py /tmp/tr_b.rank0 /tmp/tr_b.rank1 --steps 3 > $out/inbuf_timeline.txt 2>&1
head -24 $out/inbuf_timeline.txt
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
