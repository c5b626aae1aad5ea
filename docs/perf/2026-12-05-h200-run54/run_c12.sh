#!/usr/bin/env bash
# run 54, call 12 (one H100): the 256 x 128 warp-specialised WGRAD ("wide") at the shapes
# call 11 did not cover: deepseek-v3 (two variants fit 80 GB), gpt-oss-120b, and fine at
# T=16384 (1024 rows per expert, the heuristic's other branch)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
plain=wgrad:specialized=False,pingpong=False,num_stages=4,num_warps=4,block_out_m=128
wide=wgrad:specialized=True,pingpong=False,num_stages=3,num_warps=8,block_out_m=256
ab() {  # shape routing rounds log-suffix args...
  shape=$1 routing=$2 rounds=$3 sfx=$4; shift 4
  timeout 120 python3 tools/ab_interleaved.py --shape $shape --mode fwdbwd --routing $routing \
    --rounds $rounds "$@" > $OUT/ab_${shape}_$routing$sfx.log 2>&1
  echo "ab $shape $routing$sfx rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_${shape}_$routing$sfx.log | head -3
}
ab deepseek-v3 sampled 9 "" --variant wide=$wide
ab deepseek-v3 exact 9 "" --variant wide=$wide
ab gpt-oss-120b sampled 9 "" --variant wide=$wide
ab fine sampled 9 _t16384 --tokens 16384 --variant wide=$wide --variant plain=$plain
ab fine exact 9 _t16384 --tokens 16384 --variant wide=$wide
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
