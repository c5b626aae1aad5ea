#!/usr/bin/env bash
# run 44, call 8 (one H200): the Gluon W13 DGRAD below 128 rows per expert, where the
# heuristic keeps the Triton kernel: layer fwd+bwd A/Bs at D=2048 F=768 E=128 with 1024 and
# 1536 tokens (64 and 96 rows per expert), sampled routing
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=/tmp/o8; mkdir -p $out
t0=$SECONDS
G="w13_dgrad:gluon=True,block_n=128,num_warps=4,dynamic=False,pair_tails=False"
for T in 1024 1536; do
  python3 tools/ab_interleaved.py --mode fwdbwd --iters 10 --shape fine --routing sampled --rounds 9 \
    --tokens $T --variant g5=$G,num_stages=5 --variant g6=$G,num_stages=6 > $out/ab_fine_$T.log 2>&1
  echo "fine T=$T rc=$? at $((SECONDS - t0)) s"; grep -E "^ +(base|g5|g6) " $out/ab_fine_$T.log
done
tar czf /tmp/g8.tgz -C $out . && cp /tmp/g8.tgz $OUT/
