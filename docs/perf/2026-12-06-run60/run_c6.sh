#!/usr/bin/env bash
# run 60, call 6 (one H100, branch wip/w2-dgrad-expert-groups with the new heuristics: the
# W2 DGRAD's expert-group order at 128-512 rows per expert, the W2 forward's in training
# too): the GPU tests that see the picks (the heuristic test, the training partial-tile
# test's new assertion, the forward's expert-group test), the fwd+bwd layer against the
# old picks (`old`: both orders off; x < 1 on old's line: the new picks faster), then the
# fwd+bwd bench.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE --durations 4 \
  tests/ops/test_forward_gpu.py tests/ops/test_training_gpu.py \
  tests/kernels/test_backward_kernels.py \
  -k "expert_group_orders or partial_column_tiles or w2_dgrad_heuristic or w2_dgrad_expert_groups" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 8 $OUT/tests.log
OLD=old=w2:expert_groups=False+w2_dgrad:expert_groups=False
ab deepseek-v3 fwdbwd sampled 9 $OLD
ab gpt-oss-120b fwdbwd sampled 9 $OLD
ab fine fwdbwd sampled 9 $OLD
ab olmoe fwdbwd sampled 7 $OLD
left=$((D - (SECONDS - t0)))
[ $left -gt 100 ] && timeout $left python3 -m distmoe bench --mode fwdbwd \
  --shapes deepseek-v3 fine gpt-oss-120b olmoe --routing sampled --providers distmoe torch \
  --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch)" $OUT/bench.log | cut -c1-140
