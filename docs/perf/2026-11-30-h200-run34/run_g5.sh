#!/usr/bin/env bash
# call 5 (x2): fine A/B: gate (1 wave own first), gate in natural order, one launch after the join
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
ab() { local name=$1 lim=$2; shift 2
  timeout $lim python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --ep1-share --mode fwd "$@" > $out/$name.log 2>&1
  echo "$name rc=$?"; tail -7 $out/$name.log; }
ab ab_fine 230 --shape fine --rounds 31 --variant nat=layer:w13_waves=0 --variant one=layer:w13_gate=False+layer:w13_phases=False
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
