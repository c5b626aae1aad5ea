#!/usr/bin/env bash
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node=2 scratch/overlap_probe.py --shape fine --rounds 15 --share --split 88,44 --split 84,48 --split 96,36 --split 76,56 > $out/probe_fine.log 2>&1
echo "rc=$?"; grep -v "^\*\|OMP\|Warning\|warn" $out/probe_fine.log | tail -20
tar czf /tmp/m2.tgz -C $out . && cp /tmp/m2.tgz $OUT/
