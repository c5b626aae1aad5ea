"""The context's own CUDA graphs for low-precision inference (``distmoe.ops.graphs``,
``ForwardGraphs``): on one GPU, for each of mxfp8, fp8_block, nvfp4 and mxfp4, the second call
of a key is captured and every later one replayed; replayed calls with new x, ids and scores
give the eager context's bits (``graphs=False``, the same kernels), and new prepared weights
(a new object) get their own graph."""

from __future__ import annotations

import pytest
import torch

import distmoe as dm
from distmoe.quant import prepare_weights

D, F, E, T, K = 256, 256, 4, 64, 2


def _inputs(g, dev):
    x = torch.randn(T, D, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int().to(dev)
    ids[::7, 1] = -1  # inactive routes
    scores = torch.softmax(torch.randn(T, K, generator=g), 1).to(dev)
    return x, ids, scores


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block", "nvfp4", "mxfp4"])
def test_replayed_low_precision_forward_gives_the_eager_bits(precision):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    w13 = (torch.randn(E, 2, F, D, generator=g) / 16).bfloat16().to(dev)
    w2 = (torch.randn(E, D, F, generator=g) / 16).bfloat16().to(dev)
    p13, p2 = prepare_weights(w13, w2, precision)
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       precision=precision, training=False)
    calls = [_inputs(g, dev) for _ in range(4)]
    with dm.MoEContext(cfg, device=dev, graphs=False) as eager:
        want = [eager(*c, p13, p2).clone() for c in calls]
    with dm.MoEContext(cfg, device=dev) as ctx:
        got = [ctx(*c, p13, p2).clone() for c in calls]
        stats = ctx.stats()["graphs"]
        q13, q2 = prepare_weights(w13 * 0.5, w2, precision)  # new weights: a new key
        ctx(*calls[0], q13, q2)
        ctx(*calls[0], q13, q2)
        assert ctx.stats()["graphs"]["graphs"] == stats["graphs"] + 1
    assert stats["captures"] == 1 and stats["replays"] == 3, stats
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
