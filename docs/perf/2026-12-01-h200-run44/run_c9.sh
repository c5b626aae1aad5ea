#!/usr/bin/env bash
# run 44, call 9 (one H200): where the fwd+bwd step's time goes now (kernel by kernel, from a
# CUDA graph's replays) at fine and issue-a, both routings at fine
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o9; mkdir -p $out
for spec in "fine exact" "fine sampled" "issue-a exact" "olmoe sampled"; do
  set -- $spec
  timeout 100 python3 tools/profile_layer.py --shape $1 --mode fwdbwd --graph --routing $2 --rows 20 \
    > $out/profile_$1_$2.log 2>&1
  echo "== $1 $2 rc=$?"; grep -E "^ +[0-9]" $out/profile_$1_$2.log | head -16 | cut -c1-110
done
tar czf /tmp/g9.tgz -C $out . && cp /tmp/g9.tgz $OUT/
