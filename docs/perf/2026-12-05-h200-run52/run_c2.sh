#!/usr/bin/env bash
# run 52, call 2 (one H200: deepseek-v3's layer does not fit an H100): W13Config.lockstep in
# deepseek-v3's layer fwd+bwd, sampled and exact routing (its inference forward on an H100,
# call 4: 1.22x sampled, 1.07x exact); the heuristic sets lockstep there since call 5
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for spec in "deepseek-v3 sampled" "deepseek-v3 exact"; do
  set -- $spec
  left=$((300 - (SECONDS - t0))); [ $left -lt 30 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds 7 --variant off=w13:lockstep=False > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2; tail -n 1 $OUT/ab_$1_$2.log | cut -c1-160
done
