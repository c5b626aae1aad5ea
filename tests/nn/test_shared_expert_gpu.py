"""The shared expert's side stream on a GPU (MoEExperts with ``shared_ffn``): EP 1 and EP 2 as
ranks sharing GPU 0 (CUDA IPC heap). The module forks the shared branch onto its own stream,
runs the routed layer on the current one and joins; the same module's parameters and context
run again with the branch inline on the current stream, built in the same order (the shared
branch, then the routed layer, then the add: so that autograd sums x's three gradient
contributions in bf16 in the same order; ``with_shared_expert(stream=None)`` builds the
routed layer first). Both issue the same kernels on the same inputs, so y and every gradient
must be the same bits; a missing fork or join (the add or a backward reading a half-written
tensor) shows as a difference. Five steps, each with fresh random inputs (never the buffers of the
step before) and the module's output poisoned in between."""

import pytest
import torch

import distmoe as dm
from distmoe.nn import MoEExperts
from distmoe.nn.shared_expert import add_shared, shared_expert
from distmoe.reference import random_routing

T, D, F, E, K = 256, 256, 128, 8, 2
FS = 384
STEPS = 5
NAMES = "w13, w2, shared_w13, shared_w2, shared_gate_w"


def _inputs(step, rank, dev):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, scores = random_routing(T, E, K, generator=g, inactive_fraction=0.1)
    gy = torch.randn(T, D, generator=g).bfloat16()
    return x.to(dev), ids.to(dev), scores.float().to(dev), gy.to(dev)


def _step(m, x, ids, scores, gy, side_stream):
    xa, sa = x.clone().requires_grad_(), scores.clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    if side_stream:
        y = m(xa, ids, sa)
    else:  # the same parameters and context, the branch inline, in the side path's order
        h3, logit = shared_expert(xa, m.shared_w13, m.shared_w2, m.shared_gate_w)
        y = add_shared(m.context(xa, ids, sa, m.w13, m.w2), h3, logit)
    (y.float() * gy.float()).sum().backward()
    out = [y.detach().clone(), xa.grad, sa.grad]
    out += [p.grad.clone() for p in m.parameters()]
    y.detach().view(torch.int16).fill_(0x7FFF)  # poison what the next step could read
    return out


def _rank(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, training=True,
                       device_scratch_factor=float(world))
    results = []
    with MoEExperts(cfg, device=dev, seed=3, init_std=D**-0.5, shared_ffn=FS,
                    shared_gate=True) as m:
        assert m._shared_stream is not None  # the side stream exists on CUDA
        for step in range(STEPS):
            x, ids, scores, gy = _inputs(step, rank, dev)
            got = _step(m, x, ids, scores, gy, side_stream=True)
            want = _step(m, x, ids, scores, gy, side_stream=False)
            same = [torch.equal(a, b) for a, b in zip(got, want, strict=True)]
            diff = [float((a.float() - b.float()).abs().max())
                    for a, b in zip(got, want, strict=True)]
            finite = all(bool(torch.isfinite(t.float()).all()) for t in got)
            results.append((step, same, diff, finite))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("EP", [1, 2])
def test_side_stream_gives_the_inline_bits(EP):
    for rank, results in enumerate(dm.launch(_rank, EP, device="cuda", gpus=[0],
                                             timeout=300)):
        for step, same, diff, finite in results:
            assert finite and all(same), (f"rank {rank} step {step}: differ (y, x, scores, "
                                          f"{NAMES}) {same}, max abs {diff}")
