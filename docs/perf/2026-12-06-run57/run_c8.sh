#!/usr/bin/env bash
# run 57, call 8 (not run: wants an H200; for the next session): the WGRAD's device-keyed
# rule on the device it keys on. Call 6 (its GPU tests; the layer with the rule against the
# old pick at DeepSeek-V3 exact, GPT-OSS-20B at 512 rows per expert, GPT-OSS-120B), then the
# bench after the rule (fwd+bwd, both routings; run 57's call 3 benched before it). On an
# H100 the rule changes nothing: it says so and stops. Set DEADLINE (s).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-540}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if [[ $name != *H200* ]]; then echo "$name: not an H200, the rule changes nothing here"; exit 0; fi
DEADLINE=$((D - 130)) bash "$(dirname "$0")/run_c6.sh"
left=$((D - (SECONDS - t0)))
[ $left -lt 100 ] && exit 0
timeout $left python3 -m distmoe bench --mode fwdbwd --shapes deepseek-v3 gpt-oss-120b issue-a \
  --routing sampled --providers distmoe torch --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"
grep -E "^(distmoe|torch|ceiling dense)" $OUT/bench.log | cut -c1-140 | head -8
