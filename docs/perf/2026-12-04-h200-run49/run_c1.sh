#!/usr/bin/env bash
# run 49, call 1 (one H200): the named model shapes the suite leaves out (gpt-oss-120b,
# deepseek-v4-flash, qwen3-30b-a3b), exact and sampled routing, forward and fwd+bwd against
# torch; then where the fwd+bwd step's time goes at deepseek-v3 and gpt-oss-120b (kernel by
# kernel, CUDA graph replays), the two shapes furthest from the others' ratios.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
for r in exact sampled; do
  left=$((300 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 -m distmoe bench --shapes gpt-oss-120b deepseek-v4-flash qwen3-30b-a3b \
    --mode both --routing $r --providers distmoe torch --no-plots --out $OUT/bench_$r \
    > $OUT/bench_$r.log 2>&1
  echo "bench $r rc=$? at $((SECONDS - t0)) s"
  grep -E "^\|" $OUT/bench_$r.log | tail -n 20
done
for spec in "deepseek-v3 sampled" "gpt-oss-120b sampled" "deepseek-v3 exact"; do
  set -- $spec
  left=$((560 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/profile_layer.py --shape $1 --mode fwdbwd --graph --routing $2 \
    --rows 14 > $OUT/profile_$1_$2.log 2>&1
  echo "== $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[0-9]" $OUT/profile_$1_$2.log | cut -c1-100
done
