#!/usr/bin/env bash
# call 5 (two H200s, nvidia-h200-x2): the warp-specialised Gluon WGRAD at EP=2 (layer
# fwd+bwd A/B against the plain Gluon WGRAD, wgrad:specialized=False, sampled routing, fine
# and deepseek-v3); target 5 at fine (EP=2 forward against the EP=1 share).
set -u
out=/tmp/o5; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git log -1 --format=%H > $out/commit.txt; git status --short >> $out/commit.txt
R="python3 -m torch.distributed.run --standalone --nproc-per-node=2 tools/ab_interleaved.py"
for spec in "fine 11" "deepseek-v3 5"; do
  set -- $spec
  timeout 150 $R --mode fwdbwd --shape $1 --rounds $2 --iters 10 \
    --variant main=wgrad:specialized=False > $out/ab_ws_$1_ep2.log 2>&1
  echo "ab ws $1 EP=2 rc=$?"; grep -E "^ +(base|main) " $out/ab_ws_$1_ep2.log
done
timeout 150 $R --mode fwd --shape fine --ep1-share --rounds 31 --iters 20 \
  > $out/ab_t5_fine.log 2>&1
echo "target 5 fine rc=$?"; grep -E "^ +(base|ep1share)|share" $out/ab_t5_fine.log | tail -n 4
tar czf /tmp/g5.tgz -C $out . && cp /tmp/g5.tgz $OUT/
