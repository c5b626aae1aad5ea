#!/usr/bin/env bash
# Run 62 call 2 (`DEADLINE=450`): after call 1 (the W2 DGRAD's order 2.2-3.7% faster at 768
# rows per expert and at 16-24): Nsight Compute at 1024 rows (OLMoE T=8192, Qwen3-30B-A3B
# T=16384), then the layer fwd+bwd with the order forced on against the heuristic (off
# there) at OLMoE T=6144 (768 rows) and DeepSeek-V3 T=512 (16 rows). Logs in logs.tgz.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab(), ncu_eg()
for s in olmoe@8192 qwen3-30b-a3b@16384; do
  ncu_eg _gluon_w2_dgrad $s fwdbwd sampled w2_dgrad
done
ab olmoe@6144 fwdbwd sampled 9 eg=w2_dgrad:expert_groups=True
ab deepseek-v3@512 fwdbwd sampled 9 eg=w2_dgrad:expert_groups=True
echo "done at $((SECONDS - t0)) s"
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
