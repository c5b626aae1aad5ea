#!/usr/bin/env bash
# run 56, call 6 (one H100): deepseek-v3's fwd+bwd step against its DRAM traffic floor on an
# H100 after runs 51-55's picks (run 50 did this on an H200): the bandwidth ceilings, then
# the per-kernel times of the step under both routings (torch.profiler, CUDA graph)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
python3 docs/perf/2026-12-04-h200-run50/bw_ceiling.py 2>&1 | tail -n 3
for r in exact sampled; do
  timeout 200 python3 tools/profile_layer.py --shape deepseek-v3 --mode fwdbwd --routing $r \
    --graph --steps 5 --rows 20 > $OUT/profile_$r.log 2>&1
  echo "profile $r rc=$? at $((SECONDS - t0)) s"; tail -n 24 $OUT/profile_$r.log | cut -c1-150
done
