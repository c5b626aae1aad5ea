#!/usr/bin/env bash
# For the session after run 59 (any Hopper GPU, `DEADLINE=590 bash ...`, up to 10 minutes;
# not run yet): the GPU tests run 59 could not reach with its device time spent (the layer
# forward where the heuristics take the expert-group orders, the training partial-tile
# test's new W13 DGRAD assertion, the Gluon W2 kernel tests after their check was
# vectorised: --durations shows whether a test still takes a minute), then the inference
# bench at the shapes run 59's W2 pick reaches (DeepSeek-V3, GPT-OSS-120B, OLMoE at 512 rows
# per expert, fine); last, the W2 forward's order in DeepSeek-V3's fwd+bwd step again with
# more rounds (run 59 call 5 read 0.984x in 7 wide rounds, though the kernel alone reads 9%
# fewer bytes).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rfE --durations 8 \
  tests/ops/test_forward_gpu.py tests/ops/test_training_gpu.py \
  tests/kernels/test_forward_kernels.py \
  -k "expert_group_orders or partial_column_tiles or w2_gluon" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -n 14 $OUT/tests.log
timeout 240 python3 -m distmoe bench --mode fwd --shapes deepseek-v3 gpt-oss-120b olmoe fine \
  --routing sampled --providers distmoe torch --no-plots --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep -E "^(distmoe|torch)" $OUT/bench.log | cut -c1-140
ab deepseek-v3 fwdbwd sampled 11 eg2=w2:expert_groups=True
