#!/usr/bin/env bash
# run 50, call 3 (one H200): the WGRADs' ring depth at the layer (call 2: 4 stages instead of
# 5 made deepseek-v3's exact step 2.5% faster, sampled even), interleaved at the other suite
# shapes, both routings, with 3 stages as well; at deepseek-v3 also the ping-pong W13
# training forward (call 2's tune_gemm: 3% faster than the cooperative pick alone)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
for spec in "fine exact" "fine sampled" "olmoe sampled" "issue-b sampled" "issue-a exact" \
            "issue-a sampled" "olmoe exact" "deepseek-v3 exact"; do
  set -- $spec
  left=$((570 - (SECONDS - t0))); [ $left -lt 45 ] && break
  extra=""
  [ $1 = deepseek-v3 ] && extra="--variant w13pp=w13:training:num_warps=4,num_stages=5"
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 \
    --rounds 9 --variant s4=wgrad:num_stages=4 --variant s3=wgrad:num_stages=3 $extra \
    > $OUT/ab_$1_$2.log 2>&1
  echo "== $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +[a-z0-9]+ +[0-9]" $OUT/ab_$1_$2.log | cut -c1-120
done
