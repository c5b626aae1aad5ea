"""One GPU, no NVLink: W13 then W2 (the layer's Gluon configs) against the fused kernel, on
the per-rank work of an EP=2 forward with every row local (rows to a permutation of an
output buffer). Checks the fused results bit for bit against the two kernels with the same
tiles, then times all of them interleaved (CUDA graphs, median of the rounds).

    PYTHONPATH=src python3 fused_micro.py --shape fine [--rounds 21] [--remote]

``--remote``: the scattered rows of half the routes go to GPU 1's memory, as the EP=2 layer's
returns do. It failed in call 3 (illegal address: this process never enables peer access to
GPU 1) and was not used again; the layer's A/Bs measure the link instead."""
import argparse

import torch

from distmoe.kernels.w2_scatter import W2Config, w2_scatter
from distmoe.kernels.w13_gather_swiglu import W13Config, gather_w13_swiglu
from distmoe.kernels.w13_w2_gluon import FusedConfig, fused_w13_w2
from distmoe.tools.bench.timing import interleaved
from distmoe.tools.bench.workloads import SHAPES

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="fine")
ap.add_argument("--rounds", type=int, default=21)
ap.add_argument("--ep", type=int, default=2)
ap.add_argument("--remote", action="store_true")
args = ap.parse_args()
s = SHAPES[args.shape]
D, F, K = s.hidden, s.ffn, s.top_k
E = s.num_experts // args.ep
T = s.tokens
rows = T * K  # routes computed on this rank (balanced)
per = rows // E
dev = torch.device("cuda", 0)
g = torch.Generator().manual_seed(0)
x = torch.randn(T * args.ep, D, generator=g).to(torch.bfloat16).to(dev)
tok = torch.randint(0, T * args.ep, (rows,), generator=g)
seg = -(-per // 128) * 128
ptrs = torch.zeros(E * seg, dtype=torch.int64)
for e in range(E):
    ptrs[e * seg:e * seg + per] = x.data_ptr() + tok[e * per:(e + 1) * per] * D * 2
po = torch.tensor([e * seg for e in range(E + 1)], dtype=torch.int32, device=dev)
ro = torch.tensor([e * per for e in range(E + 1)], dtype=torch.int32, device=dev)
ptrs = ptrs.to(dev)
w13 = (torch.randn(E, 2, F, D, generator=g) / D ** 0.5).to(torch.bfloat16).to(dev)
w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(torch.bfloat16).to(dev)
out = torch.empty(rows, D, dtype=torch.bfloat16, device=dev)
dest = torch.randperm(rows, generator=g)
scatter = (out.data_ptr() + dest * D * 2).to(torch.int64)
if args.remote:
    torch.cuda.set_device(1)
    far = torch.empty(rows, D, dtype=torch.bfloat16, device="cuda:1")
    torch.cuda.set_device(0)
    remote = torch.zeros(rows, dtype=torch.bool)
    remote[dest % 2 == 1] = True
    scatter = torch.where(remote, far.data_ptr() + dest * D * 2, scatter)
scatter = scatter.to(dev)
h2 = torch.empty(rows, F, dtype=torch.bfloat16, device=dev)
counters = torch.zeros(E * seg // 128 + 1, dtype=torch.int32, device=dev)
c13 = W13Config.hopper_gluon(hidden=D, ffn=F, rows_per_expert=per, training=False)
c2 = W2Config.hopper_gluon(hidden=D, ffn=F, rows_per_expert=per)
print("layer configs:", c13, c2, flush=True)
coop13 = W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8,
                   persistent=True, gluon=True)
pp13 = W13Config(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=6, group_m=8,
                 persistent=True, gluon=True)
coop2 = W2Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, group_m=8,
                 persistent=True, gluon=True)
pp2 = W2Config(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6, group_m=8,
               persistent=True, gluon=True)


def seq(a, b):
    def f():
        gather_w13_swiglu(ptrs, po, ro, w13, h2, config=a)
        w2_scatter(h2, po, ro, w2, scatter, config=b)
    return f


def fused(fc):
    def f():
        counters.zero_()
        fused_w13_w2(ptrs, po, ro, w13, w2, h2, scatter, counters, config=fc)
    return f


def result(fn):
    out.fill_(float("nan"))
    h2.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    return out.clone(), h2.clone()


fns = {"seq": seq(c13, c2), "seq_coop": seq(coop13, coop2), "seq_pp": seq(pp13, pp2),
       "w13": lambda: gather_w13_swiglu(ptrs, po, ro, w13, h2, config=c13),
       "w2": lambda: w2_scatter(h2, po, ro, w2, scatter, config=c2)}
for lag in (2, 3):
    for dyn in (True, False):
        tag = "d" if dyn else "s"
        fns[f"coop{lag}{tag}"] = fused(FusedConfig(block_n=128, warps=8, stages=4, lag=lag,
                                                   dynamic=dyn))
        fns[f"pp{lag}{tag}"] = fused(FusedConfig(block_n=64, warps=4, stages=6, lag=lag,
                                                 dynamic=dyn))
for name, ref in (("coop3d", "seq_coop"), ("pp3d", "seq_pp")):
    a, b = result(fns[name]), result(fns[ref])
    same = all(torch.equal(u.view(torch.int16), v.view(torch.int16)) for u, v in zip(a, b))
    print(f"{name} bit for bit {ref}: {same}", flush=True)
stats = interleaved(fns, rounds=args.rounds, iters=10, device=dev)
base = stats["seq"].iter_ms
print(f"shape {args.shape} EP share {args.ep}, remote={args.remote}: {rows} rows, {E} experts")
for name, st in stats.items():
    print(f"{name:>9} {st.iter_ms * 1e3:8.1f} us  seq/this {base / st.iter_ms:.3f}")
