#!/usr/bin/env bash
# call 4 (x2): gated W13 Gluon kernel tests; issue-a A/B of the gate's waves against two launches
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_w13_phases.py > $out/t_phases.log 2>&1
echo "phases tests rc=$?"; tail -3 $out/t_phases.log
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
ab() { local name=$1 lim=$2; shift 2
  timeout $lim python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py --mode fwd "$@" > $out/$name.log 2>&1
  echo "$name rc=$?"; tail -7 $out/$name.log; }
ab ab_issuea 230 --shape issue-a --rounds 9 --variant g2=layer:w13_waves=2 --variant g1=layer:w13_waves=1 --variant two=layer:w13_phases=True
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
