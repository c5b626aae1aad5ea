#!/usr/bin/env bash
# call 6 (x2): at EP=2 the big-E models have half the local experts, so the mid-rows rule
# takes the Gluon W13 there (2048 tiles of 128 columns) and keeps the Triton W2: the new
# heuristic against the Triton W13 at 96 rows per local expert
set -u
out=/tmp/o6; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd"
for st in deepseek-v4-flash:2048 deepseek-v3:1536; do
  timeout 200 $R --shape ${st%:*} --tokens ${st#*:} --rounds 11 --iters 10 \
    --variant tri13=w13:inference:gluon=False > $out/ab_${st%:*}_${st#*:}_ep2.log 2>&1
  echo "ab $st EP=2 rc=$?"; grep -E "^ +(base|tri13) |_w13_cfg|_w2_cfg" $out/ab_${st%:*}_${st#*:}_ep2.log | head -5
done
tar czf /tmp/g6.tgz -C $out . && cp /tmp/g6.tgz $OUT/
