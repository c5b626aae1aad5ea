#!/usr/bin/env bash
# call 6 (x2): target 5 at fine on main (e9afde9), 31 rounds; issue-a 9 rounds
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv > $out/smi.txt 2>&1
ab() { local name=$1 lim=$2; shift 2
  timeout $lim python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --ep1-share --mode fwd "$@" > $out/$name.log 2>&1
  echo "$name rc=$?"; tail -4 $out/$name.log; }
ab t5_fine 200 --shape fine --rounds 31
ab t5_issuea 200 --shape issue-a --rounds 9
tar czf /tmp/g6.tgz -C $out . && cp /tmp/g6.tgz $OUT/
