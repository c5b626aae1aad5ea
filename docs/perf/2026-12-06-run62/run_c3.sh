#!/usr/bin/env bash
# Run 62 call 3: the W2 DGRAD's expert-group order at 16 to 768 rows per expert (was 32 to
# 512) through the GPU tests that cover its pick and kernel, and every layer test in
# training (EP=1, 2 on one GPU).
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE --durations 5 \
  tests/ops/test_training_gpu.py tests/kernels/test_backward_kernels.py \
  -k "test_training_gpu or w2_dgrad_heuristic or w2_dgrad_expert_groups or gluon_w2_dgrad" \
  > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -n 12 $OUT/tests.log
