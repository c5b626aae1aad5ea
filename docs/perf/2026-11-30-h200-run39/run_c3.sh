#!/usr/bin/env bash
# call 3 (one H200): kernel-level readings of three WGRAD partial-step forms (old: zero the
# whole step; z: zero by 16-row slices, no load for dead slices; tail: whole steps in one
# loop, the partial step after it with MMAs over live 16-row slices) and the cooperative
# W13 with a consumer loop without MMAs for an empty half (w13). Sources under scratch/v/*.
set -u
out=/tmp/o3; mkdir -p $out
export PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
PYTHONPATH=scratch/v/z/src timeout 120 python3 -m pytest -q -m gpu \
  tests/kernels/test_backward_kernels.py -k gluon_wgrad > $out/t_wgrad_z.log 2>&1
echo "wgrad tests (z) rc=$?"; tail -n 1 $out/t_wgrad_z.log
PYTHONPATH=scratch/v/tail/src timeout 120 python3 -m pytest -q -m gpu \
  tests/kernels/test_backward_kernels.py -k gluon_wgrad > $out/t_wgrad_tail.log 2>&1
echo "wgrad tests (tail) rc=$?"; tail -n 1 $out/t_wgrad_tail.log
PYTHONPATH=scratch/v/w13/src timeout 200 python3 -m pytest -q -m gpu \
  tests/kernels/test_forward_kernels.py -k "w13_gluon" > $out/t_w13.log 2>&1
echo "w13 tests (w13) rc=$?"; tail -n 1 $out/t_w13.log
M=docs/perf/2026-11-30-h200-run39/wgrad_micro.py
for rep in 1 2 3; do
  for v in old z tail; do
    PYTHONPATH=scratch/v/$v/src timeout 60 python3 $M $v >> $out/wgrad_micro.txt 2>&1
  done
done
sort -k2,3 -s $out/wgrad_micro.txt | grep -v "^\s*$"
for rep in 1 2; do
  for v in old w13; do
    for r in sampled exact; do
      f=$out/prof_${v}_fwd_${r}_$rep.txt
      PYTHONPATH=scratch/v/$v/src timeout 100 python3 tools/profile_layer.py --shape fine \
        --mode fwd --graph --steps 5 --rows 3 --routing $r > $f 2>&1
      echo "$v fwd $r rep$rep: $(grep -E 'gluon_w13|sum of' $f | tr -s ' ' | tr '\n' ';')"
    done
  done
done
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
