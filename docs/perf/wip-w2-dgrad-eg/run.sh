#!/usr/bin/env bash
# Branch wip/w2-dgrad-expert-groups (ran as run 60 call 2, logs in
# docs/perf/2026-12-06-run60/c2; merged; any Hopper GPU, about 2 minutes there): the
# expert-group tile order on the Gluon W2 DGRAD (W2DgradConfig.expert_groups, both of its
# kernels), as run 59 measured on the W2 forward and the W13 DGRAD. Its GPU tests, then the
# fwd+bwd layer against the heuristic (x > 1 on egw's line: faster), one variant per
# process (two DeepSeek-V3 fwd+bwd layers beside a third ran out of an H100's memory).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 -rfE \
  tests/kernels/test_backward_kernels.py -k "w2_dgrad_expert_groups" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 2 $OUT/tests.log
ab deepseek-v3 fwdbwd sampled 7 egw=w2_dgrad:expert_groups=True
ab fine fwdbwd sampled 9 egw=w2_dgrad:expert_groups=True
ab gpt-oss-120b fwdbwd sampled 7 egw=w2_dgrad:expert_groups=True
ab olmoe fwdbwd sampled 7 egw=w2_dgrad:expert_groups=True
ab issue-a fwdbwd exact 5 egw=w2_dgrad:expert_groups=True
