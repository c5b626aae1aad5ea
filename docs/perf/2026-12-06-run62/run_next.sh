#!/usr/bin/env bash
# For the session after run 62 (`DEADLINE=590 bash ...`). On an H200: run 61's run_c8.sh
# there (the layer against every training expert-group order off, the W2 forward's order at
# 96 rows per expert, the bench; about 3 minutes), the orders' first reading on an H200. On
# any other GPU: Nsight Compute on the W2 DGRAD at 896 rows per expert (OLMoE T=7168,
# Qwen3-30B-A3B T=14336), order off and on (about 2 minutes): run 62 read it faster at 768
# and slower at 1024, and the heuristic takes it to 768.
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ncu_eg()
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash "$(dirname "$0")/../2026-12-06-run61/run_c8.sh"
else
  ncu_eg _gluon_w2_dgrad olmoe@7168 fwdbwd sampled w2_dgrad
  ncu_eg _gluon_w2_dgrad qwen3-30b-a3b@14336 fwdbwd sampled w2_dgrad
  (cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
fi
