#!/usr/bin/env bash
# run 55, call 9 (one H100; as run): the W13 WGRAD's lockstep alone at DeepSeek-V3 and
# DeepSeek-V4-Flash (sampled)
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for s in "deepseek-v3 sampled" "deepseek-v4-flash sampled"; do
  set -- $s
  timeout 35 python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds 7 \
    --variant ls13=w13_wgrad:lockstep=True > $OUT/ab_$1_$2_w13only.log 2>&1
  echo "ab $1 $2 rc=$? at $SECONDS s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2_w13only.log | head -2
done
