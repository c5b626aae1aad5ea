#!/usr/bin/env bash
# call (x2): second readings: issue-a beside (one launch / two launches) against main's default; fine beside against main
set -u
out=/tmp/o4; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
timeout 280 $R --shape issue-a --rounds 15 --variant beside1=layer:w2_beside=True+layer:w13_phases=False --variant beside2=layer:w2_beside=True --variant one=layer:w13_phases=False > $out/ab_issuea.log 2>&1
echo "ab issue-a rc=$?"; grep -v "^\*\|OMP" $out/ab_issuea.log | tail -6
timeout 200 $R --shape fine --rounds 31 --variant beside=layer:w2_beside=True > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -4
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
