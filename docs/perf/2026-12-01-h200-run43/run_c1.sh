#!/usr/bin/env bash
# run 43, call 1 (one H200): the whole GPU test suite on the CPU-side changes of run 42's session
# (publish_ids, the backward's version check and once_differentiable, check mode's collective
# bound check, launch/heap changes) and the six untested h1_prefetch cases; per-test durations.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$SECONDS
timeout 500 python3 -m pytest -v -m "gpu or multigpu" -p no:cacheprovider --durations=40 \
  --junitxml=$OUT/junit.xml tests > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "FAILED|ERROR" $OUT/pytest.log | head -30
tail -n 45 $OUT/pytest.log
