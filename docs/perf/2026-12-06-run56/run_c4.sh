#!/usr/bin/env bash
# run 56, call 4 (an H200 wanted): runs 54-55's WGRAD picks (256 x 128 warp-specialised tiles
# from 12 MiB an expert; their producers in lockstep from 48 MiB) on an H200. Base = the
# heuristics; "pp" = the form they replaced (ping-pong 128 x 128, 5 stages); "off" = the wide
# tiles without lockstep at DeepSeek-V3's W13 WGRAD. x < 1 on a variant's line: the base is
# faster. Then the lockstep GPU tests and the bench after both picks. Set DEADLINE (s).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-560}
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
pp=wgrad:specialized=True,pingpong=True,num_stages=5,num_warps=4,block_out_m=128,lockstep=False
ab() {  # shape routing args...
  shape=$1 routing=$2; shift 2
  left=$((D - (SECONDS - t0))); [ $left -lt 60 ] && return
  timeout $left python3 tools/ab_interleaved.py --shape $shape --mode fwdbwd --routing $routing \
    --rounds 9 "$@" > $OUT/ab_${shape}_$routing.log 2>&1
  echo "ab $shape $routing rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_${shape}_$routing.log | head -3
}
ab deepseek-v3 sampled --variant off=w13_wgrad:lockstep=False --variant pp=$pp
ab deepseek-v3 exact --variant off=w13_wgrad:lockstep=False --variant pp=$pp
ab deepseek-v4-flash sampled --variant pp=$pp
ab gpt-oss-120b sampled --variant pp=$pp
ab deepseek-v4-flash exact --variant pp=$pp
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_backward_kernels.py -k "test_gluon_wgrad_lockstep" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/tests.log
for r in exact sampled; do
  left=$((D - (SECONDS - t0))); [ $left -lt 130 ] && break
  timeout $left python3 -m distmoe bench --mode fwdbwd --shapes deepseek-v3 issue-a fine \
    --routing $r --providers distmoe torch --no-plots --out $OUT/bench_$r > $OUT/bench_$r.log 2>&1
  echo "bench $r rc=$? at $((SECONDS - t0)) s"
  grep -E "^(distmoe|torch|ceiling dense)" $OUT/bench_$r.log | cut -c1-140 | head -8
done
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
