#!/usr/bin/env bash
# For the session after run 61 (`DEADLINE=590 bash ...`; not run yet: run 61's last two
# calls got no machine). On an H200: run_c8.sh there (the layer against every expert-group
# order off, the W2 forward's order at 96 rows per expert, the bench; about 3 minutes), the
# orders' first reading on an H200. On any other GPU: Nsight Compute on the W2 DGRAD at 768
# rows per expert (OLMoE at T=6144, Qwen3-30B-A3B at T=12288; the heuristic takes the
# expert-group order to 512, run 60 read 1024 even), order off and on (about 2 minutes).
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ $name == *H200* ]]; then exec bash "$(dirname "$0")/run_c8.sh"; fi
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
for s in olmoe@6144 qwen3-30b-a3b@12288; do
  ncu_eg _gluon_w2_dgrad $s fwdbwd sampled w2_dgrad
done
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
