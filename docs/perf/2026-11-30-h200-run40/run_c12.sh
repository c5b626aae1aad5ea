#!/usr/bin/env bash
# call 12 (one H200): W13 DGRAD pair_tails (the tail's MMA on block_m/2 rows) and dynamic
# hand-out: GPU tests, the kernel alone (w13d_micro.py), then the layer fwd+bwd A/B against
# main at fine and deepseek-v3, sampled and exact routing.
set -u
out=/tmp/o12; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py \
  -k "pair_tails or chain_gpu" > $out/t_w13d.log 2>&1; echo "w13d tests rc=$?"; tail -n 3 $out/t_w13d.log
ROUTINGS=exact,sampled timeout 100 python3 docs/perf/2026-11-30-h200-run40/w13d_micro.py \
  dyn=dynamic=True dynpair=pair_tails=True,dynamic=True 2>&1 | grep -v Warn | tee $out/micro.txt
AB="python3 tools/ab_interleaved.py --mode fwdbwd --variant dyn=w13_dgrad:dynamic=True --variant dynpair=w13_dgrad:dynamic=True,pair_tails=True"
for spec in "deepseek-v3 sampled 7" "fine sampled 15" "deepseek-v3 exact 5" "fine exact 11"; do
  set -- $spec
  timeout 120 $AB --shape $1 --routing $2 --rounds $3 --iters 10 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$?"; grep -E "^ +(base|dyn|dynpair) " $out/ab_$1_$2.log
done
tar czf /tmp/g12.tgz -C $out . && cp /tmp/g12.tgz $OUT/
