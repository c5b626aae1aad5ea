#!/usr/bin/env bash
# run 51, call 7 (one H200: deepseek-v3's layer does not fit an H100): W13Config.lockstep at
# the layer (fwd+bwd) at the shapes with about 128 rows per expert, where under sampled
# routing about half the experts take a second, nearly empty row block (call 6: even at
# fine, olmoe, issue-b, issue-a)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for spec in "deepseek-v3 sampled" "gpt-oss-120b sampled" "deepseek-v3 exact" "deepseek-v4-flash sampled"; do
  set -- $spec
  left=$((200 - (SECONDS - t0))); [ $left -lt 30 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds 7 --variant ls=w13:lockstep=True > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2; tail -n 1 $OUT/ab_$1_$2.log | cut -c1-160
done
