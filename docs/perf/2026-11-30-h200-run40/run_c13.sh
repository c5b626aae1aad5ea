#!/usr/bin/env bash
# call 13 (one H200): main with the W13 DGRAD's dynamic hand-out and paired tails on by
# heuristic. GPU tests (backward chain, training layer), then the layer fwd+bwd A/B against
# the old pick (w13_dgrad:dynamic=False,pair_tails=False) at the other suite shapes, sampled.
set -u
out=/tmp/o13; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py \
  -k "pair_tails or chain_gpu" > $out/t_w13d.log 2>&1; echo "w13d tests rc=$?"; tail -n 1 $out/t_w13d.log
timeout 200 python3 -m pytest -q tests/ops/test_training_gpu.py > $out/t_train.log 2>&1
echo "training gpu rc=$?"; tail -n 1 $out/t_train.log
AB="python3 tools/ab_interleaved.py --mode fwdbwd --variant old=w13_dgrad:dynamic=False,pair_tails=False"
for spec in "issue-a sampled 5" "olmoe sampled 11" "issue-b sampled 11"; do
  set -- $spec
  timeout 100 $AB --shape $1 --routing $2 --rounds $3 --iters 10 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$?"; grep -E "^ +(base|old) " $out/ab_$1_$2.log
done
tar czf /tmp/g13.tgz -C $out . && cp /tmp/g13.tgz $OUT/
