#!/usr/bin/env bash
# run 54, call 11 (one H100): call 10's kernel table put the warp-specialised 256 x 128 WGRAD
# (3 stages, 8 warps) 22-26% ahead of the heuristic at issue-a (1024 rows per expert), and the
# plain 128 x 128 kernel (4 stages, 4 warps) 3% / 20% ahead at deepseek-v3's layer (128 rows
# per expert, sampled / exact). The layer, interleaved, at more shapes with both variants
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
plain=wgrad:specialized=False,pingpong=False,num_stages=4,num_warps=4,block_out_m=128
wide=wgrad:specialized=True,pingpong=False,num_stages=3,num_warps=8,block_out_m=256
ab() {  # shape routing rounds variant...
  shape=$1 routing=$2 rounds=$3; shift 3
  timeout 120 python3 tools/ab_interleaved.py --shape $shape --mode fwdbwd --routing $routing \
    --rounds $rounds "$@" > $OUT/ab_${shape}_$routing.log 2>&1
  echo "ab $shape $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_${shape}_$routing.log | head -3
}
ab issue-a exact 9 --variant wide=$wide --variant plain=$plain
ab issue-a sampled 9 --variant wide=$wide --variant plain=$plain
ab deepseek-v4-flash sampled 9 --variant wide=$wide --variant plain=$plain
ab gpt-oss-120b sampled 9 --variant plain=$plain
ab olmoe sampled 9 --variant wide=$wide --variant plain=$plain
ab issue-b sampled 9 --variant wide=$wide --variant plain=$plain
ab deepseek-v4-flash exact 9 --variant wide=$wide --variant plain=$plain
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
