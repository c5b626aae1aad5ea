#!/usr/bin/env bash
# run 54, call 2 (one H100, 2026-12-05; the H200 of call 1 was refused): deepseek-v3's fwd+bwd
# layer with two variants only (the heuristic against the W2 DGRAD's lockstep off; run 53's
# three-variant call needs an H200's memory), then run 53's call 6 (the last 90 GPU kernel
# tests, which hold the 29 its call 4 did not reach)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout ${AB_BUDGET:-300} python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd \
  --routing sampled --rounds 7 --variant off=w2_dgrad:lockstep=False \
  > $OUT/ab_deepseek-v3_sampled.log 2>&1
echo "ab deepseek-v3 sampled rc=$? at $((SECONDS - t0)) s"
grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_deepseek-v3_sampled.log | head -3
tail -n 3 $OUT/ab_deepseek-v3_sampled.log
bash docs/perf/2026-12-05-h200-run53/run_c6.sh
echo "done at $((SECONDS - t0)) s"
