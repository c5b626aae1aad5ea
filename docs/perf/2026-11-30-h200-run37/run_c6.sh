#!/usr/bin/env bash
# call 6 (x2): how fast SMs read a peer's memory (remote_read_micro.py); x in the input
# buffer at decode (fine's experts, 64 tokens per rank, 21 rounds) and at fine once more
# (41 rounds), with the EP=1 share
set -u
out=/tmp/o6; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 docs/perf/2026-11-30-h200-run37/remote_read_micro.py > $out/remote_read.log 2>&1
echo "micro rc=$?"; grep -v "^\*\|OMP\|^W1" $out/remote_read.log | tail -14
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share --variant inbuf=input:buffer=True"
timeout 150 $R --shape fine --tokens 64 --rounds 21 > $out/ab_decode.log 2>&1
echo "ab decode rc=$?"; grep -v "^\*\|OMP" $out/ab_decode.log | tail -3
timeout 150 $R --shape fine --rounds 41 > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -3
tar czf /tmp/g6.tgz -C $out . && cp /tmp/g6.tgz $OUT/
