#!/usr/bin/env bash
# Run 62 call 3: the W2 DGRAD's expert-group order at 16 to 768 rows per expert (was 32 to
# 512) through the GPU tests that cover its pick and kernel (the Gluon W2 DGRAD's, one to
# five row blocks per expert, and from the session after run 62 one to eight in the form
# picked at 513-768 rows), and the layer training tests (EP=1, 2 on one GPU) with partial
# tiles and in CUDA graphs (cut to fit the device time left).
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE --durations 5 \
  tests/ops/test_training_gpu.py tests/kernels/test_backward_kernels.py \
  -k "partial_column_tiles or cuda_graph_training or w2_dgrad_heuristic or w2_dgrad_expert_groups" \
  > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -n 12 $OUT/tests.log
