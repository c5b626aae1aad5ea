#!/usr/bin/env bash
# run 42, call 1 (one H200): the W2 DGRAD with h1 by cp.async (W2DgradConfig.h1_prefetch).
# The GPU tests of the new form (two of its eight cases, same bits as the global loads) run
# beside the micro-benchmark's builds; the micro-benchmark times after they end; then, in what
# time is left, the layer fwd+bwd at fine under sampled routing, base against h1_prefetch=2.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
d=docs/perf/2026-12-01-h200-run42
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
t0=$SECONDS
(timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_backward_kernels.py \
   -k "h1_prefetch and ((scored and 4-2) or (offset_in_place and 2-4))" > $OUT/pytest.log 2>&1
 echo "pytest rc=$?" >> $OUT/pytest.log) &
P=$!
timeout 130 python3 $d/w2d_prefetch_micro.py --wait-pid $P fine:prod=4/0,p2=4/2,p3=3/3,p1=5/1 \
  olmoe:prod=4/0,p2=4/2 > $OUT/micro.log 2>&1
echo "micro rc=$? at $((SECONDS - t0)) s"
wait $P
tail -4 $OUT/pytest.log
grep -v "built and run" $OUT/micro.log
timeout 75 python3 tools/ab_interleaved.py --mode fwdbwd --shape fine --routing sampled --rounds 7 \
  --iters 10 --variant h1p2=w2_dgrad:h1_prefetch=2 > $OUT/ab_fine_sampled.log 2>&1
echo "ab rc=$? at $((SECONDS - t0)) s"
grep -E "^ +(base|h1p2) " $OUT/ab_fine_sampled.log
