#!/usr/bin/env bash
# run 60, call 9 (one H100; run inline as the device command, recorded here): every GPU test
# of the layer (forward and training, EP=1-4 on one GPU) with run 60's heuristics.
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 450 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE --durations 5 \
  tests/ops/test_training_gpu.py tests/ops/test_forward_gpu.py > $OUT/tests.log 2>&1
echo rc=$?; tail -n 12 $OUT/tests.log
