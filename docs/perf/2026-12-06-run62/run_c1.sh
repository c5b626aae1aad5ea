#!/usr/bin/env bash
# Run 62 call 1 (`DEADLINE=560`): Nsight Compute on expert-group orders at the row counts
# not yet read, order off and on (ab.sh's ncu_eg): the W2 DGRAD at 768 rows per expert
# (OLMoE T=6144, Qwen3-30B-A3B T=12288; heuristic on to 512, run 60 read 1024 even) and
# below its 32-row floor (DeepSeek-V3 T=512 and T=768: 16 and 24 rows); the W2 forward at
# 114 rows (DeepSeek-V4-Flash T=4864; heuristic on from 128, run 61 read 96 even). On an
# H200 first the orders' first reading there (run 61's run_c8.sh: the layer against every
# training order off, about 3 minutes). Logs in logs.tgz.
here=$(dirname "$0")
source "$here/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab(), ncu_eg()
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ $name == *H200* ]]; then
  OLD=w2:expert_groups=False+w2_dgrad:expert_groups=False+w13_dgrad:expert_groups=False
  ab deepseek-v3 fwdbwd sampled 9 old=$OLD+w13:training:expert_groups=False
  ab fine fwdbwd sampled 9 old=$OLD
fi
for s in olmoe@6144 qwen3-30b-a3b@12288 deepseek-v3@512 deepseek-v3@768; do
  ncu_eg _gluon_w2_dgrad $s fwdbwd sampled w2_dgrad
done
ncu_eg _gluon_w2_kernel deepseek-v4-flash@4864 fwd sampled w2
echo "done at $((SECONDS - t0)) s"
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
