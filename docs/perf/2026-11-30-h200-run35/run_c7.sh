#!/usr/bin/env bash
# call (x2): issue-a in a second call: main against one W13 launch, and the EP=1 share
set -u
out=/tmp/o5; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
timeout 300 $R --shape issue-a --rounds 21 --variant one=layer:w13_phases=False > $out/ab_issuea.log 2>&1
echo "ab issue-a rc=$?"; grep -v "^\*\|OMP" $out/ab_issuea.log | tail -4
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
