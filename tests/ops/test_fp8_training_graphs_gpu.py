"""FP8 training calls replayed from the context's own CUDA graphs (distmoe.ops.graphs,
FP8TrainGraphs) against the same calls launched kernel by kernel (``graphs=False``), bit for
bit: y and the gradients of x, scores, w13 and w2, with fresh inputs every step and the
weights updated in place between steps (an optimizer's step: their quantised forms are
refreshed in the same tensors, so the graphs stay), two micro-batches live at once (two
instances of one key), a forward dropped without its backward (its instance freed), at
mxfp8 and fp8_block, EP = 1 and EP = 2 as ranks sharing one GPU (IPC heap)."""

import pytest
import torch
from forward_cases import make_problem

import distmoe as dm
from distmoe.reference import split_global_problem

D, F, E, K = 256, 128, 16, 4
T = 48


def _cfg(world, precision):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=True, precision=precision, device_scratch_factor=float(world),
                        max_layers_per_slot=2)


def _grads(ctx, w, calls):
    """Forwards of every call first (micro-batches in flight), then one backward through all
    of them: y of each and the gradients of every x, scores and the weights."""
    outs, leaves = [], []
    for x, ids, scores, _ in calls:
        xs, sc = x.clone().requires_grad_(True), scores.clone().requires_grad_(True)
        leaves += [xs, sc]
        outs.append(ctx(xs, ids, sc, *w))
    loss = sum((y.float() * gy.float()).sum() for y, (*_, gy) in zip(outs, calls, strict=True))
    grads = torch.autograd.grad(loss, leaves + list(w))
    return [y.detach() for y in outs] + list(grads)


def _rank(rank, world, precision):
    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    with dm.MoEContext(_cfg(world, precision), device=dev) as fast, \
            dm.MoEContext(_cfg(world, precision), device=dev, graphs=False) as slow:
        assert type(fast.graphs).__name__ == "FP8TrainGraphs" and slow.graphs is None
        p = split_global_problem(*make_problem(5, world, T, D, F, E, K, "inactive_mix"),
                                 world)[rank]
        weights = {c: tuple(t.to(dev).requires_grad_(True) for t in (p.w13, p.w2))
                   for c in (fast, slow)}
        for step in range(5):
            calls = []
            for mb in range(2 if step >= 3 else 1):  # two micro-batches in flight from step 3
                q = split_global_problem(*make_problem(100 * step + mb, world, T, D, F, E, K,
                                                       "inactive_mix"), world)[rank]
                g = torch.Generator().manual_seed(7 + 100 * step + mb + rank)
                calls.append(tuple(t.to(dev) for t in (q.x, q.expert_ids, q.scores)) +
                             (torch.randn(T, D, generator=g).bfloat16().to(dev),))
            got = _grads(fast, weights[fast], calls)
            want = _grads(slow, weights[slow], calls)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            finite = all(bool(torch.isfinite(t.float()).all()) for t in got)
            results.append((step, len(calls), same, finite))
            with torch.no_grad():  # an optimizer's step: the same tensors, new values
                for w13, w2 in weights.values():
                    w13.mul_(0.999).add_(0.001)
                    w2.mul_(0.999).sub_(0.001)
        before = fast.stats()["graphs"]["forward_graphs"]
        x, ids, scores, _ = calls[0]
        y = fast(x.clone().requires_grad_(True), ids, scores.clone().requires_grad_(True),
                 *weights[fast])
        del y  # dropped without a backward: its instance is free again
        fast.reset_slots()
        y = fast(x.clone().requires_grad_(True), ids, scores.clone().requires_grad_(True),
                 *weights[fast])
        y.float().sum().backward()
        stats = fast.stats()["graphs"]
    return results, stats, before


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
@pytest.mark.parametrize("world", [1, 2])
def test_fp8_training_graphs_give_the_eager_bits(world, precision):
    kw = dict(device="cuda", gpus=[0], timeout=600) if world > 1 else {}
    per_rank = (dm.launch(_rank, world, args=(precision,), **kw) if world > 1
                else [_rank(0, 1, precision)])
    for results, stats, before in per_rank:
        for step, calls, same, finite in results:
            assert finite, f"step {step}: non-finite values"
            assert same, f"step {step} ({calls} micro-batches): graphs differ from eager"
        # a key's second call captures; two micro-batches in flight take two instances
        assert stats["forward_graphs"] == 2 and stats["backward_graphs"] == 2, stats
        assert stats["replays"] > 0, stats
        assert before == stats["forward_graphs"], (before, stats)  # no third instance
