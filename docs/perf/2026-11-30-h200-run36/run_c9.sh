#!/usr/bin/env bash
# call 9 (x2): the fused kernel at three more shapes (EP=2 forward, with the EP=1 share):
# deepseek-v3, olmoe, issue-b; its default (ping-pong, lag 3, static) and cooperative lag 3
set -u
out=/tmp/o9; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
for shape in olmoe issue-b deepseek-v3; do
  rounds=21; [ $shape = deepseek-v3 ] && rounds=11
  timeout 150 $R --shape $shape --rounds $rounds --variant fused=layer:fused=True --variant coop3=layer:fused=True+layer:fused_pp=False > $out/ab_$shape.log 2>&1
  echo "ab $shape rc=$?"; grep -v "^\*\|OMP" $out/ab_$shape.log | tail -5
done
tar czf /tmp/g9.tgz -C $out . && cp /tmp/g9.tgz $OUT/
