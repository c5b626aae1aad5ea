#!/usr/bin/env bash
# run 52, call 3 (one H100): W13Config.lockstep at the layer where call 1 found it 2.6% faster
# (gpt-oss-120b, sampled, fwd+bwd): under exact routing, the inference forward (lockstep on
# for both modes), and issue-b fwd+bwd again (the other shape at 128 rows per expert)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
for spec in "gpt-oss-120b fwdbwd exact" "gpt-oss-120b fwd sampled" "issue-b fwdbwd sampled" \
            "gpt-oss-120b fwdbwd sampled" "issue-b fwd sampled"; do
  set -- $spec
  left=$((300 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --routing $3 \
    --rounds 9 --variant ls=w13:lockstep=True > $OUT/ab_$1_$2_$3.log 2>&1
  echo "ab $1 $2 $3 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2_$3.log | head -2
done
