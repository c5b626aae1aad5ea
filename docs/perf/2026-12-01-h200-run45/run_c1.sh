#!/usr/bin/env bash
# run 45, call 1 (one H200): the GPU test suite's first half in one sweep (every kernel test,
# then the forward's GPU tests) on HEAD, with per-test durations; run 44 tested only the
# changed paths, and GLUON_W13D_NULL's rows 1216 / 1920 have not run on a GPU yet.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null
t0=$SECONDS
timeout 545 python3 -m pytest -v -m "gpu or multigpu" -p no:cacheprovider --durations=25 \
  --junitxml=$OUT/junit1.xml tests/kernels tests/ops/test_forward_gpu.py > $OUT/pytest1.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest1.log | head -30
grep -E "PASSED|FAILED|SKIPPED|ERROR" $OUT/pytest1.log | sed 's/::.*\(PASSED\|FAILED\|SKIPPED\|ERROR\).*/ \1/' | sort | uniq -c
tail -n 3 $OUT/pytest1.log
