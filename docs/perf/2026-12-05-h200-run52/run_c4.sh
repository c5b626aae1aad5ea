#!/usr/bin/env bash
# run 52, call 4 (one H100): W13Config.lockstep in the inference forward (call 3: 8.5% faster
# at gpt-oss-120b, 1.8% at issue-b, both 128 rows per expert) at the other shapes: deepseek-v3
# (128 rows; its forward alone fits 80 GB), fine (256), olmoe (512), issue-a (2048), and
# decode (--tokens 64 at issue-a and deepseek-v3)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for spec in "deepseek-v3 fwd sampled" "fine fwd sampled" "olmoe fwd sampled" "issue-a fwd sampled" \
            "issue-a fwd sampled 64" "deepseek-v3 fwd sampled 64" "deepseek-v3 fwd exact"; do
  set -- $spec
  left=$((400 - (SECONDS - t0))); [ $left -lt 40 ] && break
  tok=(); [ $# -ge 4 ] && tok=(--tokens $4)
  log=$OUT/ab_$1_$2_$3${4:+_t$4}.log
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --routing $3 "${tok[@]}" \
    --rounds 9 --variant ls=w13:lockstep=True > $log 2>&1
  echo "ab $* rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $log | head -2
  grep -E "Error|error" $log | tail -2
done
