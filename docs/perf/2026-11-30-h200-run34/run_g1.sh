#!/usr/bin/env bash
# call 1 (x2): gated W13: GPU tests (kernel + layer, graph replay), fine A/B at EP=2
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_w13_phases.py > $out/t_phases.log 2>&1
echo "phases tests rc=$?"; tail -3 $out/t_phases.log
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q tests/ops/test_forward_gpu.py -k "graph or schedules" > $out/t_fwd.log 2>&1
echo "fwd tests rc=$?"; tail -3 $out/t_fwd.log
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
ab() { local name=$1 lim=$2; shift 2
  timeout $lim python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --ep1-share --mode fwd "$@" > $out/$name.log 2>&1
  echo "$name rc=$?"; tail -7 $out/$name.log; }
ab ab_fine 200 --shape fine --rounds 25 --variant one=layer:w13_gate=False+layer:w13_phases=False --variant two=layer:w13_phases=True
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
