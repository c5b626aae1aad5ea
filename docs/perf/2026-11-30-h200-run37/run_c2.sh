#!/usr/bin/env bash
# call 2 (x2): x in the input buffer against main, with the EP=1 share (each variant's line
# now gives its own time over the share's): fine again (41 rounds), then olmoe, issue-b
# (21 rounds) and deepseek-v3 (11 rounds)
set -u
out=/tmp/o2; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share --variant inbuf=input:buffer=True"
for a in "fine 41" "olmoe 21" "issue-b 21" "deepseek-v3 11"; do
  set -- $a
  timeout 170 $R --shape $1 --rounds $2 > $out/ab_$1.log 2>&1
  echo "ab $1 rc=$?"; grep -v "^\*\|OMP" $out/ab_$1.log | tail -3
done
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
