"""Eager training calls replayed from the context's own CUDA graphs (distmoe.ops.graphs,
TrainingGraphs): forward and backward give the bits of the same calls launched kernel by
kernel (``graphs=False``), with fresh inputs every step (for 6 steps), weights updated in place between
steps (an optimizer's step), two layers stacked in one slot, two token counts, saving and
replaying slots, at EP = 1 and at EP = 2 as ranks sharing one GPU (IPC heap). With
``main_grad=True`` the fp32 weight-gradient buffers after every step are bit-equal too."""

import pytest
import torch
from forward_cases import make_problem

import distmoe as dm
from distmoe.ops.graphs import TrainingGraphs
from distmoe.reference import split_global_problem

D, F, E, K = 256, 128, 16, 4
LAYERS = 2


def _cfg(world, T_max, mode):
    base = dict(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T_max, training=True,
                device_scratch_factor=float(world), max_layers_per_slot=LAYERS)
    plan = dm.plan_memory(dm.MoEConfig(**base), world)
    cap = plan.min_slot_bytes if mode == "replay" else plan.useful_max_slot_bytes
    return dm.MoEConfig(**base, activation_bytes=cap)


def _step(ctx, weights, inputs, gys):
    """One training step through the stack of layers: y of each layer, and the gradients of
    x, scores, w13 and w2 of each (the upstream gradient of layer i is gys[i]; with
    ``ctx.main_grad`` those of x and scores, the weights' go to their main_grad)."""
    outs = []
    leaves = []
    for (w13, w2), (x, ids, scores) in zip(weights, inputs, strict=True):
        xs = x.clone().requires_grad_(True)
        sc = scores.clone().requires_grad_(True)
        leaves.append((xs, sc) if ctx.main_grad else (xs, sc, w13, w2))
        outs.append(ctx(xs, ids, sc, w13, w2))
    loss = sum((y.float() * gy.float()).sum() for y, gy in zip(outs, gys, strict=True))
    grads = torch.autograd.grad(loss, [t for group in leaves for t in group])
    return [y.detach() for y in outs] + list(grads)


def _graphs_rank(rank, world, Ts, mode, whole=False):
    dev = torch.device("cuda", torch.cuda.current_device())
    main_grad = mode.endswith("main_grad")
    cfg = _cfg(world, max(Ts), mode.removesuffix("_main_grad"))
    results = []
    with dm.MoEContext(cfg, device=dev, main_grad=main_grad) as fast, \
            dm.MoEContext(cfg, device=dev, graphs=False, main_grad=main_grad) as slow:
        assert fast.graphs is not None and slow.graphs is None
        fast.graphs.whole_backward = whole
        weights = {fast: [], slow: []}  # the same values, main_grad buffers of their own
        for i in range(LAYERS):
            p = split_global_problem(*make_problem(100 + i, world, max(Ts), D, F, E, K,
                                                   "inactive_mix"), world)[rank]
            for ws in weights.values():
                ws.append(tuple(w.to(dev).requires_grad_(True) for w in (p.w13, p.w2)))
                for w in ws[-1]:
                    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
        for step in range(6):
            for T in Ts:
                inputs, gys = [], []
                for i in range(LAYERS):  # fresh inputs every call, never the captured ones
                    p = split_global_problem(*make_problem(1000 * step + 10 * T + i, world,
                                                           T, D, F, E, K, "inactive_mix"),
                                             world)[rank]
                    inputs.append(tuple(t.to(dev) for t in (p.x, p.expert_ids, p.scores)))
                    g = torch.Generator().manual_seed(7 + 1000 * step + 10 * T + i + rank)
                    gys.append(torch.randn(T, D, generator=g).bfloat16().to(dev))
                got = _step(fast, weights[fast], inputs, gys)
                want = _step(slow, weights[slow], inputs, gys)
                if main_grad:
                    got += [w.main_grad for ws in weights[fast] for w in ws]
                    want += [w.main_grad for ws in weights[slow] for w in ws]
                same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
                finite = all(bool(torch.isfinite(t.float()).all()) for t in got)
                results.append((step, T, same, finite))
            with torch.no_grad():  # an optimizer's step: the same tensors, new values
                for ws in weights.values():
                    for w13, w2 in ws:
                        w13.mul_(0.999).add_(0.001)
                        w2.mul_(0.999).sub_(0.001)
        stats = fast.stats()["graphs"]
        depth = fast.stats()["activations"]["slot_depth"]
    return results, stats, depth


@pytest.mark.gpu
@pytest.mark.parametrize("whole", [False, True], ids=["three_parts", "whole_backward"])
@pytest.mark.parametrize("mode", ["save", "replay", "save_main_grad"])
@pytest.mark.parametrize("EP", [1, 2])
def test_graphed_training_calls_give_the_eager_bits(EP, mode, whole):
    Ts = (64, 200)
    for results, stats, depth in dm.launch(_graphs_rank, EP, device="cuda", gpus=[0],
                                           timeout=600, args=(Ts, mode, whole)):
        for step, T, same, finite in results:
            assert finite and same, (step, T, mode)
        keys = len(Ts) * LAYERS  # token counts x layers in the slot
        # step 0: every call eager; step 1: forward and backward captured (and replayed)
        assert stats["forward_graphs"] == keys and stats["backward_graphs"] == keys, stats
        # weight gradients: graphed where their outputs land at an address seen before, else
        # eager. The main_grad buffers never move: graphed from the second call of a key on.
        # New .grad tensors land where torch's caching allocator puts them (the eager
        # context's calls interleave here), so their count is bounded, not predicted.
        # With whole_backward those addresses get a graph of the whole backward instead.
        graphed = stats["whole_backward_graphs" if whole else "weight_graphs"]
        assert stats["whole_backward_graphs" if not whole else "weight_graphs"] == 0, stats
        if mode.endswith("main_grad"):
            assert graphed == keys, stats
        assert graphed <= TrainingGraphs.max_weight_graphs * keys, stats
        assert stats["captures"] == 2 * keys + graphed, stats
        assert depth == [0] * len(depth), depth  # every layer left its slot
