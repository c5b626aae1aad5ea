#!/usr/bin/env bash
# run 58, call 12 (one H200, after call 11 = run 57's run_c8.sh): the fwd+bwd bench under
# exact routing after run 57's WGRAD rule (call 11 benched sampled), as one command line:
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,temperature.gpu --format=csv,noheader
timeout 300 python3 -m distmoe bench --mode fwdbwd --shapes deepseek-v3 gpt-oss-120b issue-a fine \
  --routing exact --providers distmoe torch --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
echo rc=$?; grep -E "^(distmoe|torch|ceiling dense)" $OUT/bench.log | cut -c1-140
