#!/usr/bin/env bash
# run 44, call 12 (one H200): the split W2 DGRAD is bound by its operands' bytes (call 11);
# does the tile walk's group-M (L2 reuse) move it? Layer fwd+bwd A/Bs: the W2 DGRAD with
# group-M 4 / 16 (base 8), the Gluon W13 DGRAD with group-M 16
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o12; mkdir -p $out
t0=$SECONDS
AB="python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --variant d4=w2_dgrad:group_m=4 --variant d16=w2_dgrad:group_m=16 --variant w16=w13_dgrad:group_m=16"
for spec in "fine exact 9" "fine sampled 9" "olmoe sampled 7"; do
  set -- $spec
  left=$((300 - (SECONDS - t0)))
  [ $left -lt 40 ] && { echo "ab $1 $2 skipped (time)"; continue; }
  timeout $(( left < 100 ? left : 100 )) $AB --shape $1 --routing $2 --rounds $3 > $out/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|d4|d16|w16) " $out/ab_$1_$2.log
done
tar czf /tmp/g12.tgz -C $out . && cp /tmp/g12.tgz $OUT/
