#!/usr/bin/env bash
# run 55, call 5 (one H100; as run): the probe at 128 rows per expert (its stdout:
# c5/probe_time.txt), then the plain WGRAD against the heuristics' (wide) at DeepSeek-V3's
# layer, exact and sampled routing
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; d=docs/perf/2026-12-05-run55
python3 $d/wgrad_probe.py --time 2>&1 | tail -9
plain=wgrad:specialized=False,pingpong=False,num_stages=4,num_warps=4,block_out_m=128
for r in exact sampled; do
  timeout 150 python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd --routing $r \
    --rounds 7 --variant plain=$plain > $OUT/ab_deepseek-v3_$r.log 2>&1
  echo "ab $r rc=$? at $SECONDS s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_deepseek-v3_$r.log | head -2
done
