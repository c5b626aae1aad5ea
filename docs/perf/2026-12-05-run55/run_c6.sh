#!/usr/bin/env bash
# run 55, call 6 (one H100; as run): the wide WGRAD with 32-row steps and 6 stages against
# the heuristics' (64-row steps, 3 stages) at DeepSeek-V3 and issue-a's layer
export PYTHONPATH=src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
k32=wgrad:specialized=True,pingpong=False,num_stages=6,num_warps=8,block_out_m=256,block_k=32
for r in sampled exact; do
  timeout 150 python3 tools/ab_interleaved.py --shape deepseek-v3 --mode fwdbwd --routing $r \
    --rounds 7 --variant k32s6=$k32 > $OUT/ab_deepseek-v3_${r}_k32.log 2>&1
  echo "ab $r rc=$? at $SECONDS s"
  grep -E "^ +[a-z0-9]+ +[0-9.]+ \(|Error|error" $OUT/ab_deepseek-v3_${r}_k32.log | head -4
done
timeout 100 python3 tools/ab_interleaved.py --shape issue-a --mode fwdbwd --routing exact \
  --rounds 7 --variant k32s6=$k32 > $OUT/ab_issue-a_exact_k32.log 2>&1
echo "ab issue-a rc=$? at $SECONDS s"
grep -E "^ +[a-z0-9]+ +[0-9.]+ \(|Error" $OUT/ab_issue-a_exact_k32.log | head -3
