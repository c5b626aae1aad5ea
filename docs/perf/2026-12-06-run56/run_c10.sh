#!/usr/bin/env bash
# run 56, call 10 (one H100): does the W13 forward read its weights faster in 256-byte runs?
# The TMA stream probe (the forward's, the DGRAD's and the paired orders, nothing else in
# the kernel), then W13Config.stage_steps=2 (two K steps a stage, loaded back to back; 2
# stages of 96 KiB for the cooperative tile): its GPU tests, and the layer against the
# heuristic (x > 1 on st2's line: two steps a stage faster). Set DEADLINE (s).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-400}
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm --format=csv,noheader
timeout 150 python3 docs/perf/2026-12-06-run56/tma_stream.py --rounds 3 > $OUT/tma_stream.log 2>&1
echo "probe rc=$? at $((SECONDS - t0)) s"; tail -n 12 $OUT/tma_stream.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_forward_kernels.py -k "two_steps_a_stage or test_gpu_w13_gluon_lockstep" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | head -8
ab() {  # shape mode routing variant-spec
  left=$((D - (SECONDS - t0))); [ $left -lt 40 ] && return
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --routing $3 --rounds 9 \
    --variant st2=$4 > $OUT/ab_$1_$2_$3.log 2>&1
  echo "ab $1 $2 $3 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2_$3.log | head -2
}
st2=w13:training:stage_steps=2,num_stages=2
ab deepseek-v3 fwdbwd exact $st2
ab deepseek-v3 fwdbwd sampled $st2
ab deepseek-v3 fwd sampled w13:inference:stage_steps=2,num_stages=2
ab issue-a fwdbwd exact $st2
ab fine fwdbwd sampled $st2
