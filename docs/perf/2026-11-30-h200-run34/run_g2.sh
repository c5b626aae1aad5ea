#!/usr/bin/env bash
# call 2 (x2): gated W13: Gluon kernel tests; fine one-step timelines, gate (default) and one launch
set -u
out=/tmp/o; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log --oneline -1 > $out/commit.txt; git status --short >> $out/commit.txt
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_w13_phases.py -k gated > $out/t_phases.log 2>&1
echo "phases tests rc=$?"; tail -3 $out/t_phases.log
prof() { local name=$1; shift
  timeout 80 python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/profile_layer.py --shape fine --mode fwd --graph --steps 3 --trace $out/tr_$name "$@" > $out/prof_$name.log 2>&1
  echo "prof $name rc=$?"
  python3 tools/trace_timeline.py $out/tr_$name.rank0 $out/tr_$name.rank1 --steps 3 > $out/${name}_timeline.txt 2>&1; rm -f $out/tr_$name.rank*; }
prof gate
prof one --set layer:w13_gate=False --set layer:w13_phases=False
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
for n in gate one; do echo "== $n"; grep -n "Memcpy\|gluon\|phase\|barrier\|combine\|Memset\|Memory" $out/${n}_timeline.txt | head -24; done
