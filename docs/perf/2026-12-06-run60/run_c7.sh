#!/usr/bin/env bash
# run 60, call 7 (one H100, the new heuristics): the W13 DGRAD's expert-group order (run 59's
# pick at 256-512 rows per expert) where it was not measured on the Gluon kernel: 128 rows
# per expert (issue-b, olmoe at T=1024), 1024 (olmoe at T=8192), and 256 / 512 again for
# the kernel alone (fine, olmoe). Nsight Compute on the third fwd+bwd step's _gluon_w2_kernel
# launches (skip 4, count 2: the W2 forward, then the W13 DGRAD on the same kernel).
source "$(dirname "$0")/../2026-12-06-run58/ab.sh"  # environment, t0, D, the GPU, ab()
here=$(dirname "$0")/../2026-12-06-run58
M=gpu__time_duration.sum,dram__bytes_read.sum
for s in issue-b olmoe@1024 fine olmoe olmoe@8192; do
  for eg in False True; do
    [ $((SECONDS - t0)) -gt $((D - 40)) ] && break 2
    timeout 120 ncu --clock-control none -k regex:_gluon_w2_kernel --launch-skip 4 \
      --launch-count 2 --metrics $M python3 $here/ncu_layer_variant.py $s fwdbwd sampled \
      w13_dgrad:expert_groups=$eg > $OUT/ncu_${s/@/_t}_eg$eg.log 2>&1
    echo "ncu $s eg=$eg rc=$? at $((SECONDS - t0)) s"
    grep -E "^  [_a-z]|gpu__time|dram__" $OUT/ncu_${s/@/_t}_eg$eg.log | sed -E 's/ +/ /g' \
      | cut -c1-70
  done
done
