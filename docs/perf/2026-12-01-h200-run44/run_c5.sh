#!/usr/bin/env bash
# run 44, call 5 (one H200): the layer with the committed heuristic (base: the Gluon W13 DGRAD
# where picked) against run 43's production W13 DGRAD (tri: Triton 128 x 256, counter
# hand-out, paired tails), fwd+bwd, interleaved; the configs each variant runs are printed
# first (the base's pick is checked there)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o5; mkdir -p $out
t0=$SECONDS
AB="python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --variant tri=w13_dgrad:gluon=False,block_n=256,num_warps=8,num_stages=4,dynamic=True,pair_tails=True"
for spec in "fine exact 9" "fine sampled 9" "issue-a exact 9" "olmoe sampled 7" "issue-b sampled 7" "issue-a sampled 7" "deepseek-v3 sampled 3"; do
  set -- $spec
  left=$((560 - (SECONDS - t0)))
  [ $left -lt 50 ] && { echo "ab $1 $2 skipped (time)"; continue; }
  timeout $(( left < 120 ? left : 120 )) $AB --shape $1 --routing $2 --rounds $3 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -iE "w13_dgrad|W13Dgrad" $out/ab_$1_$2.log | cut -c1-160 | head -2; grep -E "^ +(base|tri) " $out/ab_$1_$2.log
done
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
