#!/usr/bin/env bash
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $out/gpu.txt
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node=2 scratch/peer_store_micro.py > $out/micro.log 2>&1
echo "rc=$?"; grep -v "^\*\|OMP" $out/micro.log | tail -30
tar czf /tmp/m1.tgz -C $out . && cp /tmp/m1.tgz $OUT/
