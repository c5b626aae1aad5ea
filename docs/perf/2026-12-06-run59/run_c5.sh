#!/usr/bin/env bash
# run 59, call 5 (any Hopper GPU): the expert-group GPU tests call 4 did not run (no test
# hangs: call 4 ran eight, the W2 ones take 60-77 s each alone, so call 3's 8 workers ran
# out of time), then DeepSeek-V3's fwd+bwd layer with each expert-group variant alone (call
# 3 ran both in one process and ran out of GPU memory on the H100).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 -rfE \
  tests/kernels/test_forward_kernels.py tests/kernels/test_backward_kernels.py \
  -k "(w2_gluon_expert_groups or w13_dgrad_expert_groups) and not 3-free-128x256coop and not \
1-free-128x128 and not 3-free-128x128 and not None-free-128x128 and not free-pingpong" \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/tests.log
ab deepseek-v3 fwdbwd sampled 7 egd=w13_dgrad:expert_groups=True
ab deepseek-v3 fwdbwd sampled 7 eg2=w2:expert_groups=True
