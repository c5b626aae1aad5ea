#!/usr/bin/env bash
# run 52, call 5 (one H100): the heuristic now sets W13Config.lockstep at 128-191 rows per
# expert, and a wait that misses its bound ends the program's lockstep. The W13 GPU tests
# (lockstep with twice as many programs as SMs among them), the layer GPU tests, and the
# heuristic against lockstep off at gpt-oss-120b (forward, fwd+bwd) and issue-b (forward)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,temperature.gpu,clocks.sm,power.draw,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_forward_kernels.py -m gpu \
  -k "lockstep or heuristic or gluon_w13" > $OUT/pytest_w13.log 2>&1
echo "pytest w13 rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/pytest_w13.log; grep -E "^FAILED|^ERROR" $OUT/pytest_w13.log | head -8
timeout 240 python3 -m pytest -q -p no:cacheprovider -x tests/ops -m gpu > $OUT/pytest_ops.log 2>&1
echo "pytest ops rc=$? at $((SECONDS - t0)) s"; tail -n 1 $OUT/pytest_ops.log; grep -E "^FAILED|^ERROR" $OUT/pytest_ops.log | head -8
for spec in "gpt-oss-120b fwd" "gpt-oss-120b fwdbwd" "issue-b fwd"; do
  set -- $spec
  left=$((520 - (SECONDS - t0))); [ $left -lt 40 ] && break
  timeout $left python3 tools/ab_interleaved.py --shape $1 --mode $2 --routing sampled \
    --rounds 9 --variant off=w13:lockstep=False > $OUT/ab_$1_$2.log 2>&1
  echo "ab $* rc=$? at $((SECONDS - t0)) s"; grep -E "lockstep=|^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | cut -c1-60,190-260 | head -4
done
