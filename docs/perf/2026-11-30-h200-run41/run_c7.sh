#!/usr/bin/env bash
# call 7 (one H200): the ping-pong WGRAD as the heuristic's pick (128-column tiles): GPU
# tests (Gluon WGRAD, backward chain, training layer), then layer fwd+bwd A/Bs against the
# old pick (old = two cooperating warpgroups of 8 warps).
set -u
out=/tmp/o7; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_backward_kernels.py -k "gluon_wgrad or chain_gpu" > $out/t_bwd.log 2>&1
echo "bwd tests rc=$?"; tail -n 1 $out/t_bwd.log
timeout 200 python3 -m pytest -q tests/ops/test_training_gpu.py > $out/t_train.log 2>&1
echo "training gpu rc=$?"; tail -n 1 $out/t_train.log
AB="python3 tools/ab_interleaved.py --mode fwdbwd --variant old=wgrad:num_warps=8,pingpong=False"
for spec in "fine sampled 11" "fine exact 11" "deepseek-v3 sampled 5" "issue-b sampled 11" "olmoe sampled 11"; do
  set -- $spec
  timeout 150 $AB --shape $1 --routing $2 --rounds $3 --iters 10 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$?"; grep -E "^ +(base|old) " $out/ab_$1_$2.log
done
tar czf /tmp/g7.tgz -C $out . && cp /tmp/g7.tgz $OUT/
