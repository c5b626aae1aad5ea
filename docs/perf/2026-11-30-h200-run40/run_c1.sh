#!/usr/bin/env bash
# call 1 (one H200): W13 DGRAD half tails (w13_dgrad:half_tails=True, off on main). GPU tests,
# then layer fwd+bwd A/Bs against main at fine and deepseek-v3 under sampled and exact routing.
set -u
out=/tmp/o1; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log -1 --format=%H > $out/commit.txt; git status --short >> $out/commit.txt
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py \
  -k "half_tails or chain_gpu" > $out/t_w13d.log 2>&1; echo "w13d tests rc=$?"; tail -n 1 $out/t_w13d.log
AB="python3 tools/ab_interleaved.py --mode fwdbwd --variant half=w13_dgrad:half_tails=True"
for spec in "fine sampled 15" "deepseek-v3 sampled 7" "fine exact 11" "deepseek-v3 exact 5"; do
  set -- $spec
  timeout 110 $AB --shape $1 --routing $2 --rounds $3 --iters 10 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$?"; grep -v "^\*\|OMP" $out/ab_$1_$2.log | tail -n 3
done
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
