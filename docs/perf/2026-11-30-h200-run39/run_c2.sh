#!/usr/bin/env bash
# call 2 (one H200): the WGRAD's partial last step over live 16-row slices only, and the
# cooperative W13 consumer without live rows skipping its MMAs. Kernel tests on the GPU,
# then per-kernel tables at fine, old (scratch/old/src = the session's first commit's
# kernels) and new alternating, sampled and exact routing; then the bench at fine and
# issue-a under sampled routing.
set -u
out=/tmp/o2; mkdir -p $out
export PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
PYTHONPATH=src timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py \
  -k gluon_wgrad > $out/t_wgrad.log 2>&1; echo "wgrad tests rc=$?"; tail -n 2 $out/t_wgrad.log
PYTHONPATH=src timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_forward_kernels.py \
  -k gluon_w13 > $out/t_w13.log 2>&1; echo "w13 tests rc=$?"; tail -n 2 $out/t_w13.log
for rep in 1 2; do
  for code in old new; do
    src=src; [ $code = old ] && src=scratch/old/src
    for r in sampled exact; do
      f=$out/prof_${code}_fwdbwd_${r}_$rep.txt
      PYTHONPATH=$src timeout 100 python3 tools/profile_layer.py --shape fine --mode fwdbwd \
        --graph --steps 5 --rows 6 --routing $r > $f 2>&1
      echo "$code fwdbwd $r rep$rep rc=$?: $(grep -E 'wgrad|gluon_w13|sum of' $f | tr -s ' ' | tr '\n' ';')"
    done
    f=$out/prof_${code}_fwd_sampled_$rep.txt
    PYTHONPATH=$src timeout 100 python3 tools/profile_layer.py --shape fine --mode fwd \
      --graph --steps 5 --rows 4 --routing sampled > $f 2>&1
    echo "$code fwd sampled rep$rep rc=$?: $(grep -E 'gluon_w13|sum of' $f | tr -s ' ' | tr '\n' ';')"
  done
done
PYTHONPATH=src timeout 150 python3 -m distmoe bench --mode both --shapes fine issue-a \
  --routing sampled --providers distmoe torch --no-plots --no-ceilings --out $out/bench_sampled \
  > $out/bench_sampled.log 2>&1
echo "bench sampled rc=$?"; grep -E "^(distmoe|torch) " $out/bench_sampled.log
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
