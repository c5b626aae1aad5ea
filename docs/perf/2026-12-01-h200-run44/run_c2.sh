#!/usr/bin/env bash
# run 44, call 2 (one H200): layer fwd+bwd A/Bs, base = the layer's Triton W13 DGRAD (run 40's
# 128 x 256 tiles, counter hand-out, paired tails), variants = the Gluon W13 DGRAD, ping-pong
# 128 x 128 tiles with 5 (g5) or 6 (g6) ring stages
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o2; mkdir -p $out
t0=$SECONDS
G="w13_dgrad:gluon=True,block_n=128,num_warps=4"
AB="python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --variant g5=$G,num_stages=5 --variant g6=$G,num_stages=6"
for spec in "fine sampled 7" "fine exact 7" "olmoe sampled 7" "issue-b sampled 7" "issue-a exact 5" "deepseek-v3 sampled 5"; do
  set -- $spec
  left=$((560 - (SECONDS - t0)))
  [ $left -lt 50 ] && { echo "ab $1 $2 skipped (time)"; continue; }
  timeout $(( left < 110 ? left : 110 )) $AB --shape $1 --routing $2 --rounds $3 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|g5|g6) " $out/ab_$1_$2.log
done
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
