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
M=gpu__time_duration.sum,dram__bytes_read.sum
ncu_py=$(dirname "$0")/../2026-12-06-run58/ncu_layer_variant.py
for s in olmoe@6144 qwen3-30b-a3b@12288; do
for eg in False True; do
  [ $((SECONDS - t0)) -gt $((D - 40)) ] && break
  timeout 100 ncu --clock-control none -k regex:_gluon_w2_dgrad --launch-skip 2 \
    --launch-count 1 --metrics $M python3 $ncu_py \
    $s fwdbwd sampled w2_dgrad:expert_groups=$eg > $OUT/ncu_w2dg_${s/@/_t}_eg$eg.log 2>&1
  echo "ncu W2 DGRAD $s eg=$eg rc=$?"
  grep -E "^  [_a-z]|gpu__time|dram__" $OUT/ncu_w2dg_${s/@/_t}_eg$eg.log | sed -E 's/ +/ /g' | cut -c1-70
done; done
(cd $OUT && tar czf logs.tgz --remove-files -- *.log 2>/dev/null); ls $OUT
