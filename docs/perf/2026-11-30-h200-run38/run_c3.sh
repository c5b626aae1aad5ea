#!/usr/bin/env bash
# call 3 (one H200): the same at other model shapes (96 and 64 rows per expert), and the Gluon W2 at 32-48 rows
# (inference, interleaved A/Bs against the heuristic, which keeps the Triton kernels there)
set -u
out=/tmp/o3; mkdir -p $out
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
for st in deepseek-v4-flash:4096 gpt-oss-120b:3072 gpt-oss-120b:2048 deepseek-v3:3072 deepseek-v3:2048; do
  ab 0 ${st%:*} ${st#*:}
done
for st in fine:512 issue-a:192; do  # below 64 rows the heuristic already takes the Gluon W13
  CUDA_VISIBLE_DEVICES=0 timeout 75 python3 tools/ab_interleaved.py --mode fwd --shape ${st%:*} --tokens ${st#*:} \
    --rounds 11 --iters 20 --variant gw2=$G2 > $out/ab_${st%:*}_${st#*:}.log 2>&1
  echo "ab $st rc=$?" >> $out/ab_${st%:*}_${st#*:}.log
done
for f in $out/ab_*.log; do echo "== $f"; grep -E "^ +(base|gw13|gw2|both) |rc=" $f; done
tar czf /tmp/g3.tgz -C $out . && cp /tmp/g3.tgz $OUT/
