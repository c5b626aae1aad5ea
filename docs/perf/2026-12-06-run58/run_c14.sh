#!/usr/bin/env bash
# run 58, call 14 (any Hopper GPU): the W13 forward's expert-group tile order
# (W13Config.expert_groups; sections 3-4: group-M 1 reads the rows from DRAM less often but
# separates an expert's row blocks, and streams DRAM slower under a router's histogram).
# Its GPU tests, then the layer against the heuristic (x > 1 on eg's line: faster).
source "$(dirname "$0")/ab.sh"  # the environment, t0, D, the GPU's name, ab()
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_forward_kernels.py -k "expert_groups" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/tests.log
ab deepseek-v3 fwd sampled 11 eg=w13:inference:expert_groups=True
ab deepseek-v3 fwd exact 9 eg=w13:inference:expert_groups=True
ab gpt-oss-120b fwd sampled 11 eg=w13:inference:expert_groups=True
ab olmoe@1024 fwd sampled 11 eg=w13:inference:expert_groups=True
ab issue-a fwd exact 9 eg=w13:inference:expert_groups=True
ab fine fwd sampled 9 eg=w13:inference:expert_groups=True
ab deepseek-v3 fwdbwd sampled 7 eg=w13:training:expert_groups=True
