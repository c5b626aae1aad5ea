#!/usr/bin/env bash
# call 1 (one H200): the warp-specialised WGRAD with 32-row steps (deeper rings) against the
# heuristic's 64-row steps, kernel alone (4 shapes, both routings), then in the layer
# fwd+bwd under sampled routing (fine, deepseek-v3); per-kernel tables at fine, both routings.
set -u
out=/tmp/o1; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $out/gpu.txt
timeout 300 python3 docs/perf/2026-11-30-h200-run41/wgrad_bk_micro.py > $out/micro.txt 2>&1
echo "micro rc=$?"; cat $out/micro.txt | grep -v Warn | tail -n 20
AB="python3 tools/ab_interleaved.py --mode fwdbwd --variant k32s10=wgrad:block_k=32,num_stages=10"
for spec in "fine sampled 11" "deepseek-v3 sampled 5" "fine exact 11"; do
  set -- $spec
  timeout 150 $AB --shape $1 --routing $2 --rounds $3 --iters 10 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$?"; grep -E "^ +(base|k32s10) " $out/ab_$1_$2.log
done
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
