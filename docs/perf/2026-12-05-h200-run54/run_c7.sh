#!/usr/bin/env bash
# run 54, call 7 (one H100): deepseek-v3's fwd+bwd step is 2.6% slower under exact routing
# (128 rows for every expert) than under sampled routing (call 6), though sampled routing
# leaves nearly empty last tiles; the per-kernel times under both, from graph replays
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
for routing in sampled exact; do
  timeout 150 python3 tools/profile_layer.py --shape deepseek-v3 --mode fwdbwd --graph \
    --steps 5 --rows 20 --routing $routing > $OUT/profile_$routing.log 2>&1
  echo "profile $routing rc=$? at $((SECONDS - t0)) s"
  tail -n 24 $OUT/profile_$routing.log | cut -c1-150
done
