#!/usr/bin/env bash
# call 4 (one H200): the Gluon W13 / W2 at 64-127 rows per expert for few tiles (the new
# heuristic): what it picks per shape, the GPU tests (a forward at 100 rows per expert
# among them), then A/Bs with the Triton kernels as the variant (inference), and the
# training forward+backward at fine T=1536 with the Triton W2 as the variant
set -u
out=/tmp/o4; mkdir -p $out
export PYTHONPATH=src PYTHONUNBUFFERED=1
git status --short > $out/commit.txt
python3 - > $out/picks.txt 2>&1 <<'PY'
import torch
from distmoe.kernels.w13_gather_swiglu import W13Config
from distmoe.kernels.w2_scatter import W2Config
from distmoe.tools.bench.workloads import SHAPES
dev = torch.device("cuda", 0)
for name, tokens in (("fine", 1024), ("fine", 1536), ("olmoe", 768), ("issue-a", 384),
                     ("gpt-oss-120b", 3072), ("deepseek-v4-flash", 4096), ("deepseek-v3", 3072)):
    s = SHAPES[name]
    hint = tokens * s.top_k // s.num_experts
    w13 = W13Config.from_heuristic(hidden=s.hidden, ffn=s.ffn, rows_per_expert=hint,
                                   device=dev, num_experts=s.num_experts)
    w2 = W2Config.from_heuristic(hidden=s.hidden, ffn=s.ffn, rows_per_expert=hint, device=dev,
                                 num_experts=s.num_experts)
    print(f"{name} T={tokens} rows/expert={hint}: W13 gluon={w13.gluon} W2 gluon={w2.gluon}")
PY
cat $out/picks.txt
timeout 260 python3 -m pytest -q tests/ops/test_forward_gpu.py > $out/t_fwd.log 2>&1; echo "forward gpu rc=$?"; tail -n 2 $out/t_fwd.log
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_forward_kernels.py -k "heuristic" > $out/t_heur.log 2>&1; echo "heuristic gpu rc=$?"; tail -n 1 $out/t_heur.log
TRI="w13:inference:gluon=False+w2:gluon=False,block_n=256,num_warps=8,num_stages=4"
for st in fine:1536 olmoe:768 issue-a:384 fine:1024; do
  timeout 75 python3 tools/ab_interleaved.py --mode fwd --shape ${st%:*} --tokens ${st#*:} --rounds 11 --iters 20 \
    --variant tri=$TRI > $out/ab_${st%:*}_${st#*:}.log 2>&1; echo "ab $st rc=$?"
  grep -E "^ +(base|tri) " $out/ab_${st%:*}_${st#*:}.log
done
timeout 120 python3 tools/ab_interleaved.py --mode fwdbwd --shape fine --tokens 1536 --rounds 11 --iters 10 \
  --variant tri2=w2:gluon=False,block_n=256,num_warps=8,num_stages=4 > $out/ab_fine_1536_train.log 2>&1; echo "ab fine train rc=$?"
grep -E "^ +(base|tri2) |_w2_cfg|_w13_cfg" $out/ab_fine_1536_train.log | head -6
tar czf /tmp/g4.tgz -C $out . && cp /tmp/g4.tgz $OUT/
