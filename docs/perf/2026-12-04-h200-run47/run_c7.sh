#!/usr/bin/env bash
# run 47, call 7 (one H200): after the plan left the scratch copy of the rows out where they
# are read in place (adf5e36): the GPU training tests of those modes and of the copy.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 150 python3 -m pytest -v -p no:cacheprovider -k "inplace or regather" \
  tests/ops/test_training_gpu.py > $OUT/pytest.log 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
grep -E "PASSED|FAILED|ERROR" $OUT/pytest.log | sed 's/.*:://' | head -20; tail -n 1 $OUT/pytest.log
