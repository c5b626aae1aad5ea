#!/usr/bin/env bash
# call 7 (x2): the session's final code (89a4285): the heuristic's picks on the GPU, the
# two-GPU tests, then the forward and training GPU tests side by side (one GPU each)
set -u
out=/tmp/o7; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
python3 - > $out/picks.txt 2>&1 <<'PY'
import torch
from distmoe.kernels.w13_gather_swiglu import W13Config
from distmoe.kernels.w2_scatter import W2Config
from distmoe.tools.bench.workloads import SHAPES
dev = torch.device("cuda", 0)
for name, tokens, ep in (("fine", 1536, 1), ("olmoe", 768, 1), ("issue-a", 384, 1),
                         ("deepseek-v4-flash", 4096, 1), ("fine", 512, 2),
                         ("deepseek-v4-flash", 2048, 2), ("deepseek-v3", 1536, 2)):
    s = SHAPES[name]
    E = s.num_experts // ep
    hint = tokens * s.top_k // E
    w13 = W13Config.from_heuristic(hidden=s.hidden, ffn=s.ffn, rows_per_expert=hint,
                                   device=dev, num_experts=E)
    w2 = W2Config.from_heuristic(hidden=s.hidden, ffn=s.ffn, rows_per_expert=hint, device=dev,
                                 num_experts=E, ep_size=ep)
    print(f"{name} T={tokens} EP={ep} rows/expert={hint}: W13 gluon={w13.gluon} W2 gluon={w2.gluon}")
PY
cat $out/picks.txt
timeout 220 python3 -m pytest -q -m multigpu tests/ops/test_multigpu.py tests/runtime/test_heap.py > $out/t_multi.log 2>&1
echo "multigpu rc=$?"; tail -n 1 $out/t_multi.log
(CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m pytest -q tests/ops/test_forward_gpu.py tests/test_interpreter.py > $out/t_fwd.log 2>&1; echo "forward gpu rc=$?" >> $out/t_fwd.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 230 python3 -m pytest -q tests/ops/test_training_gpu.py > $out/t_train.log 2>&1; echo "training gpu rc=$?" >> $out/t_train.log) &
wait
tail -n 2 $out/t_fwd.log $out/t_train.log
tar czf /tmp/g7.tgz -C $out . && cp /tmp/g7.tgz $OUT/
