#!/usr/bin/env bash
# call 8 (x2): peer-store micro: store cache modifiers and grids, 64 MiB both ways
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node=2 scratch/store_bench.py > $out/store_bench.log 2>&1
echo "rc=$?"; grep -v "^\*\|OMP" $out/store_bench.log | tail -20
tar czf /tmp/g8.tgz -C $out . && cp /tmp/g8.tgz $OUT/
