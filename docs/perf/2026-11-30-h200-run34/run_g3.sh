#!/usr/bin/env bash
# call 3 (x2): gated W13: tests (kernel, one GPU shared, one rank per GPU), issue-a A/B
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_w13_phases.py > $out/t_phases.log 2>&1
echo "phases tests rc=$?"; tail -3 $out/t_phases.log
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q tests/ops/test_forward_gpu.py -k "schedules or share" > $out/t_fwd.log 2>&1
echo "fwd tests rc=$?"; tail -3 $out/t_fwd.log
timeout 150 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py -k "forward or schedules or gated" > $out/t_multi.log 2>&1
echo "multigpu tests rc=$?"; tail -3 $out/t_multi.log
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
ab() { local name=$1 lim=$2; shift 2
  timeout $lim python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --ep1-share --mode fwd "$@" > $out/$name.log 2>&1
  echo "$name rc=$?"; tail -7 $out/$name.log; }
ab ab_issuea 170 --shape issue-a --rounds 9 --variant two=layer:w13_phases=True --variant one=layer:w13_gate=False+layer:w13_phases=False
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
