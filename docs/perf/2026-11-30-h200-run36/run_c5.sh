#!/usr/bin/env bash
# call 5 (x2): the run-time hand-out with a relaxed atomic (call 4: acq_rel): kernel tests,
# the one-GPU micro against W13 then W2, the A/B at fine
set -u
out=/tmp/o5; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -x -m gpu tests/kernels/test_w2_beside.py -k "fused" > $out/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; tail -3 $out/kernel_tests.log
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 docs/perf/2026-11-30-h200-run36/fused_micro.py --shape fine --rounds 15 > $out/micro_local.log 2>&1; echo "micro rc=$?"; tail -14 $out/micro_local.log
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd --ep1-share"
F=layer:fused=True
timeout 240 $R --shape fine --rounds 21 --variant pp3s=$F+layer:fused_pp=True+layer:fused_lag=3+layer:fused_dynamic=False --variant pp3d=$F+layer:fused_pp=True+layer:fused_lag=3 --variant pp2d=$F+layer:fused_pp=True --variant coop3d=$F+layer:fused_lag=3 --variant coop2d=$F > $out/ab_fine.log 2>&1
echo "ab fine rc=$?"; grep -v "^\*\|OMP" $out/ab_fine.log | tail -8
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
