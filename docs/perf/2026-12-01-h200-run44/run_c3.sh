#!/usr/bin/env bash
# run 44, call 3 (one H200): where the Gluon W13 DGRAD stops winning. Layer fwd+bwd A/Bs as in
# call 2 at shapes whose experts' W13 weights are 32-58 MiB each (deepseek-v3 exact; issue-a
# and deepseek-v4-flash with fewer / more tokens), and issue-a exact again with more rounds
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o3; mkdir -p $out
t0=$SECONDS
G="w13_dgrad:gluon=True,block_n=128,num_warps=4"
AB="python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --variant g5=$G,num_stages=5 --variant g6=$G,num_stages=6"
for spec in "deepseek-v3 exact 5 4096" "issue-a sampled 7 2048" "deepseek-v4-flash sampled 5 8192" "issue-a sampled 7 1024" "issue-a exact 11 8192"; do
  set -- $spec
  left=$((560 - (SECONDS - t0)))
  [ $left -lt 50 ] && { echo "ab $1 $2 $4 skipped (time)"; continue; }
  timeout $(( left < 130 ? left : 130 )) $AB --shape $1 --routing $2 --rounds $3 --tokens $4 > $out/ab_$1_$2_$4.log 2>&1
  echo "ab $1 $2 T=$4 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|g5|g6) " $out/ab_$1_$2_$4.log
done
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
