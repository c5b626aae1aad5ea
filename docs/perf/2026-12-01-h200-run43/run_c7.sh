#!/usr/bin/env bash
# run 43, call 7 (one H200, the session's last 274 s of device time): the split W2 DGRAD
# with h1 loaded a quarter ahead (epilogue_early_h1): its GPU tests and the scored Gluon
# tests against the Triton kernel (the SwiGLU math now shared), then the kernel alone
# against the split kernel as picked. Logs straight into $OUT (a cut-off call keeps them).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 40 -x \
  tests/kernels/test_backward_kernels.py -k "(split_epilogue and True) or gluon_w2_dgrad_scored" \
  > $OUT/t_early.log 2>&1
rc=$?; echo "tests rc=$rc at $((SECONDS - t0)) s"; tail -n 3 $OUT/t_early.log | cut -c1-300
if [ $rc -eq 0 ]; then
  timeout 70 python3 docs/perf/2026-12-01-h200-run42/w2d_prefetch_micro.py \
    fine:e8=4/0/8/1,e8e=4/0/8/1/1 issue-a:e8s5=5/0/8/1,e8s5e=5/0/8/1/1 > $OUT/micro_early.log 2>&1
  echo "micro rc=$? at $((SECONDS - t0)) s"; grep -v "built and run" $OUT/micro_early.log | tail -n 3
fi
