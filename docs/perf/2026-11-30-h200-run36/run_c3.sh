#!/usr/bin/env bash
# call 3 (x2): the fused kernel against W13 then W2 on one GPU (no link; then half the rows
# stored into GPU 1), and one-step timelines of the EP=2 layer at fine: main and fused pp3
set -u
out=/tmp/o3; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
M=docs/perf/2026-11-30-h200-run36/fused_micro.py
timeout 150 python3 $M --shape fine --rounds 15 > $out/micro_local.log 2>&1; echo "micro local rc=$?"; tail -16 $out/micro_local.log
timeout 150 python3 $M --shape fine --rounds 15 --remote > $out/micro_remote.log 2>&1; echo "micro remote rc=$?"; tail -13 $out/micro_remote.log
P="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/profile_layer.py --shape fine --mode fwd --graph --steps 3"
timeout 100 $P --trace /tmp/tr_s > $out/prof_s.log 2>&1; echo "prof s rc=$?"
timeout 100 $P --trace /tmp/tr_f --set layer:fused=True --set layer:fused_pp=True --set layer:fused_lag=3 > $out/prof_f.log 2>&1; echo "prof f rc=$?"
python3 tools/trace_timeline.py /tmp/tr_s.rank0 /tmp/tr_s.rank1 --steps 3 > $out/seq_timeline.txt 2>&1
python3 tools/trace_timeline.py /tmp/tr_f.rank0 /tmp/tr_f.rank1 --steps 3 > $out/fused_timeline.txt 2>&1
head -40 $out/fused_timeline.txt
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
