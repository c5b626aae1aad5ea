#!/usr/bin/env bash
# run 50, call 2 (one H200): deepseek-v3's kernels furthest from their weight-traffic floor
# (call 1: the WGRADs write at 85-89% of the write-only ceiling; by run 49's profile the
# training W13 forward reads its 15 GB of weights at about 73% of the read-only ceiling and
# the W2 DGRAD at about 70%): their configs swept (tune_gemm, interleaved finals), then the
# W2 WGRAD's 4-stage ring (call 1: 13% faster in one sequential sweep, even in the other)
# at the layer, interleaved
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw --format=csv,noheader
timeout 300 python3 tools/tune_gemm.py --shapes deepseek-v3 --backward \
  --kernels w13_train w2_dgrad_scored --final 4 --rounds 7 --csv $OUT/tune_gemm.csv \
  > $OUT/tune_gemm.log 2>&1
echo "tune_gemm rc=$? at $((SECONDS - t0)) s"
grep -E "interleaved|median|HEUR|^[a-z]" $OUT/tune_gemm.log | tail -n 40 | cut -c1-170
for r in sampled exact; do
  left=$((560 - (SECONDS - t0))); [ $left -lt 60 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd --routing $r \
    --rounds 7 --variant s4=w2_wgrad:num_stages=4 --variant s4both=wgrad:num_stages=4 \
    > $OUT/ab_wgrad_$r.log 2>&1
  echo "ab $r rc=$? at $((SECONDS - t0)) s"; tail -n 5 $OUT/ab_wgrad_$r.log | cut -c1-170
done
