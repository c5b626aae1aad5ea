#!/usr/bin/env bash
# run 58, call 4 (any Hopper GPU): the W13 forward's tile order at the layer. Call 3 (the
# probe on branch wip/w13-prefetch, the kernel alone at DeepSeek-V3, one H100) read group-M
# 1 3.4% faster than the heuristic's 8 (inference and training) and 2 2.3%; here the layer
# against the heuristic, x > 1 on a variant's line: faster. Set DEADLINE (s).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-540}
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
ab() {  # shape mode routing rounds variant...
  local shape=$1 mode=$2 routing=$3 rounds=$4; shift 4
  left=$((D - (SECONDS - t0))); [ $left -lt 40 ] && return
  local args=(); for v in "$@"; do args+=(--variant "$v"); done
  timeout $left python3 tools/ab_interleaved.py --shape $shape --mode $mode --routing $routing \
    --rounds $rounds "${args[@]}" > $OUT/ab_${shape}_${mode}_${routing}.log 2>&1
  echo "ab $shape $mode $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_${shape}_${mode}_${routing}.log | head -3
}
ab deepseek-v3 fwd exact 9 g1=w13:inference:group_m=1 g2=w13:inference:group_m=2
ab deepseek-v3 fwd sampled 9 g1=w13:inference:group_m=1 g2=w13:inference:group_m=2
ab deepseek-v3 fwdbwd exact 7 g1=w13:training:group_m=1
ab issue-a fwd exact 9 g1=w13:inference:group_m=1 g2=w13:inference:group_m=2
ab fine fwd sampled 9 g1=w13:inference:group_m=1 g2=w13:inference:group_m=2
ab gpt-oss-120b fwd sampled 9 g1=w13:inference:group_m=1 g2=w13:inference:group_m=2
