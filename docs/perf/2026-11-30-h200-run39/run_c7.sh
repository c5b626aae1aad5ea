#!/usr/bin/env bash
# call 7 (one H200): the warp-specialised Gluon WGRAD as the Hopper heuristic's pick for
# 128-column tiles. GPU tests (kernel, training layer), then the layer A/B against the plain
# Gluon WGRAD (wgrad:specialized=False) at fine and deepseek-v3 under sampled routing, then the
# bench's fwd+bwd at fine and deepseek-v3 under sampled routing (device time was short).
set -u
out=/tmp/o7; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py -k gluon_wgrad \
  > $out/t_wgrad.log 2>&1; echo "wgrad tests rc=$?"; tail -n 1 $out/t_wgrad.log
timeout 200 python3 -m pytest -q tests/ops/test_training_gpu.py > $out/t_train.log 2>&1
echo "training gpu rc=$?"; tail -n 1 $out/t_train.log
AB="python3 tools/ab_interleaved.py --mode fwdbwd --variant main=wgrad:specialized=False"
for spec in "fine sampled 11" "deepseek-v3 sampled 5"; do
  set -- $spec
  timeout 100 $AB --shape $1 --routing $2 --rounds $3 --iters 10 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$?"; grep -v "^\*\|OMP" $out/ab_$1_$2.log | tail -n 2
done
for r in sampled; do
  timeout 90 python3 -m distmoe bench --mode fwdbwd --shapes fine deepseek-v3 --routing $r \
    --providers distmoe torch --no-plots --no-ceilings --out $out/bench_$r > $out/bench_$r.log 2>&1
  echo "bench $r rc=$?"; grep -E "^(distmoe|torch) " $out/bench_$r.log
done
tar czf /tmp/g7.tgz -C $out . && cp /tmp/g7.tgz $OUT/
