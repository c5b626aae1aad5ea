#!/usr/bin/env bash
# call 2 (one H200; x2 was not lent): the Gluon W13 / W2 at 64-127 rows per expert
# (inference, interleaved A/Bs against the heuristic, which keeps the Triton kernels there)
set -u
out=/tmp/o2; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt; git log --oneline -1 >> $out/commit.txt
G13="w13:inference:gluon=True,block_n=128,num_warps=8,num_stages=4"
G2="w2:gluon=True,block_n=128,num_warps=4,num_stages=6"
ab() {  # gpu shape tokens
  CUDA_VISIBLE_DEVICES=$1 timeout 75 python3 tools/ab_interleaved.py --mode fwd --shape $2 --tokens $3 \
    --rounds 11 --iters 20 --variant gw13=$G13 --variant gw2=$G2 --variant both=$G13+$G2 \
    > $out/ab_$2_$3.log 2>&1
  echo "ab $2 T=$3 rc=$?" >> $out/ab_$2_$3.log
}
for st in issue-a:384 fine:1536 olmoe:768 issue-a:256 fine:1024 issue-a:480 fine:1920; do
  ab 0 ${st%:*} ${st#*:}
done
for f in $out/ab_*.log; do echo "== $f"; grep -E "^ +(base|gw13|gw2|both) |rc=" $f; done
tar czf /tmp/g2.tgz -C $out . && cp /tmp/g2.tgz $OUT/
