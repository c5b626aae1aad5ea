#!/usr/bin/env bash
# run 57, call 7 (branch wip/w13-k32, which holds main's WGRAD rule): the W13 forward's
# cooperative tile in 32-column K steps
# (8 stages of 24 KiB: the same 192 KiB, more of it in flight; section 1 found the whole
# ring in flight and 3 stages 4.6% slower than 4): its GPU tests, then the layer against
# the heuristic (x > 1 on k32's line: faster); then, with the time left, call 6 (the WGRAD
# rule's GPU tests and its A/Bs on an H200). Set DEADLINE (s).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
D=${DEADLINE:-300}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_forward_kernels.py -k "gluon_k32" > $OUT/tests_k32.log 2>&1
echo "k32 tests rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/tests_k32.log
ab() {  # shape mode routing variant-spec
  left=$((D - (SECONDS - t0))); [ $left -lt 40 ] && return
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --routing $3 --rounds 9 \
    --variant k32=$4 > $OUT/ab_k32_$1_$2_$3.log 2>&1
  echo "ab k32 $1 $2 $3 rc=$? at $((SECONDS - t0)) s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_k32_$1_$2_$3.log | head -2
}
ab deepseek-v3 fwd sampled w13:inference:block_k=32,num_stages=8
ab deepseek-v3 fwdbwd exact w13:training:block_k=32,num_stages=8
ab issue-a fwd exact w13:inference:block_k=32,num_stages=8
ab fine fwd sampled w13:inference:block_k=32,num_stages=8
left=$((D - (SECONDS - t0))); [ $left -gt 60 ] && DEADLINE=$left bash docs/perf/2026-12-06-run57/run_c6.sh
