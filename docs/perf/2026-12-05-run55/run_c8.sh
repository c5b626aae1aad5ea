#!/usr/bin/env bash
# run 55, call 8 (one H100; as run): the WGRADs' lockstep at GPT-OSS-120B (sampled),
# DeepSeek-V4-Flash (exact) and issue-a (sampled)
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for s in "gpt-oss-120b sampled" "deepseek-v4-flash exact" "issue-a sampled"; do
  set -- $s
  timeout 40 python3 tools/ab_interleaved.py --shape $1 --mode fwdbwd --routing $2 --rounds 7 \
    --variant ls=wgrad:lockstep=True > $OUT/ab_$1_$2.log 2>&1
  echo "ab $1 $2 rc=$? at $SECONDS s"; grep -E "^ +[a-z0-9]+ +[0-9.]+ \(" $OUT/ab_$1_$2.log | head -2
done
