#!/usr/bin/env bash
# Run 61 call 6: the new picks (the W13 forward's expert-group order in training at the
# lockstep rows; the W2 DGRAD's from 32 rows per expert) through the GPU tests that cover
# them (every layer test in training, EP=1, 2 on one GPU), then the fwd+bwd bench at the
# two lockstep shapes.
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
timeout 400 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE --durations 5 \
  tests/ops/test_training_gpu.py tests/kernels/test_forward_kernels.py \
  tests/kernels/test_backward_kernels.py \
  -k "test_training_gpu or w13_gluon_heuristic or gluon_w13_choice or w13_gluon_expert_groups or w2_dgrad_heuristic or w2_dgrad_expert_groups" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 8 $OUT/tests.log
timeout 150 python3 -m distmoe bench --mode fwdbwd --shapes deepseek-v3 gpt-oss-120b \
  --routing sampled --providers distmoe torch --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch)" $OUT/bench.log | cut -c1-140
(cd $OUT && tar czf logs.tgz --remove-files -- *.log bench 2>/dev/null); ls $OUT
