#!/usr/bin/env bash
# call 1 (one H200): where sampled routing costs the layer. Per-kernel tables at fine (fwd
# and fwd+bwd, CUDA graph) under exact and sampled routing, then the bench at fine and
# issue-a, both modes, both routings, against the torch baseline.
set -u
out=/tmp/o1; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $out/gpu.txt
for mode in fwd fwdbwd; do
  for r in exact sampled; do
    timeout 120 python3 tools/profile_layer.py --shape fine --mode $mode --graph --steps 5 \
      --rows 30 --routing $r > $out/prof_fine_${mode}_$r.txt 2>&1
    echo "prof $mode $r rc=$?"; tail -n 3 $out/prof_fine_${mode}_$r.txt
  done
done
for r in exact sampled; do
  timeout 200 python3 -m distmoe bench --mode both --shapes fine issue-a --routing $r \
    --providers distmoe torch --no-plots --out $out/bench_$r > $out/bench_$r.log 2>&1
  echo "bench $r rc=$?"; tail -n 14 $out/bench_$r.log
done
tar czf /tmp/g1.tgz -C $out . && cp /tmp/g1.tgz $OUT/
