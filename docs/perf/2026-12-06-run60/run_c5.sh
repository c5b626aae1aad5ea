#!/usr/bin/env bash
# run 60, call 5 (one H100; run inline as the device command, recorded here): call 4's W2
# forward profiles printed nothing (its grep missed the kernel line; the logs did not come
# back). Every _gluon_w2* kernel of DeepSeek-V3's three eager fwd+bwd steps, the W2
# forward's order off and on (the W13 DGRAD runs the Triton kernel at this shape).
export PYTHONPATH=src; M=gpu__time_duration.sum,dram__bytes_read.sum
for eg in False True; do
  timeout 100 ncu --clock-control none -k regex:_gluon_w2 --launch-skip 0 --launch-count 12 \
    --metrics $M python3 docs/perf/2026-12-06-run58/ncu_layer_variant.py deepseek-v3 fwdbwd \
    sampled w2:expert_groups=$eg > $OUT/w2fwd_eg$eg.log 2>&1
  echo rc=$?
  grep -E "^  [_a-z]|gpu__time|dram__" $OUT/w2fwd_eg$eg.log | sed -E 's/ +/ /g' | cut -c1-80
done
