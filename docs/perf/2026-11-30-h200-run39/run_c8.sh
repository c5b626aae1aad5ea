#!/usr/bin/env bash
# call 8 (one H200, the machine of call 7 still warm), main with the warp-specialised WGRAD:
# the bench's fwd+bwd at four shapes under both routings (issue-a's WGRAD keeps the plain
# Gluon kernel: 128 x 256 tiles at 2048 rows per expert)
export PYTHONPATH=src; mkdir -p /tmp/o8
for r in exact sampled; do
  timeout 110 python3 -m distmoe bench --mode fwdbwd --shapes fine issue-b olmoe deepseek-v3 \
    --routing $r --providers distmoe torch --no-plots --no-ceilings --out /tmp/o8/bench_$r \
    > /tmp/o8/bench_$r.log 2>&1
  echo "bench $r rc=$?"; grep -E "^(distmoe|torch) " /tmp/o8/bench_$r.log
done
git status --short > /tmp/o8/commit.txt
tar czf /tmp/g8.tgz -C /tmp/o8 . && cp /tmp/g8.tgz $OUT/
