"""A training step of the ``"nccl"`` transport captured in one CUDA graph (issue 61, item 2):
the all-gather, the inner one-rank layer's forward and backward, the reduce-scatter, all
stream-ordered with fixed sizes, so the capture holds the whole step; replays with fresh
inputs give the eager step's bits. One GPU: EP = 1 over a one-rank NCCL group (NCCL does not
let two ranks share a GPU, so EP > 1 needs more GPUs than the tests are lent)."""

import pytest
import torch
from forward_cases import make_problem

import distmoe as dm
from distmoe.reference import split_global_problem

T, D, F, E, K = 128, 256, 128, 16, 4


def _step(ctx, x, ids, scores, w13, w2, gy):
    leaves = [x.clone().requires_grad_(True), scores.clone().requires_grad_(True)]
    y = ctx(leaves[0], ids, leaves[1], w13, w2)
    grads = torch.autograd.grad((y.float() * gy.float()).sum(), [*leaves, w13, w2])
    return [y.detach(), *grads]


def _capture_rank(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, training=True)
    problems = [split_global_problem(*make_problem(40 + i, world, T, D, F, E, K,
                                                   "inactive_mix" if i % 2 else "imbalance_8x"),
                                     world)[rank] for i in range(3)]
    out = {}
    with dm.MoEContext(cfg, device=dev, transport="nccl") as ctx:
        out["transport"] = ctx.transport
        w13, w2 = (t.to(dev).requires_grad_(True) for t in (problems[0].w13, problems[0].w2))
        static = [t.to(dev).clone() for t in (problems[0].x, problems[0].expert_ids,
                                              problems[0].scores)]
        gy = torch.randn(T, D, generator=torch.Generator().manual_seed(rank)).bfloat16().to(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (the inner context's own graphs step aside in capture)
                _step(ctx, *static, w13, w2, gy)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _step(ctx, *static, w13, w2, gy)
        same = []
        for p in problems[1:] + problems[:1]:  # fresh inputs, then the captured ones again
            inputs = [t.to(dev) for t in (p.x, p.expert_ids, p.scores)]
            for s, t in zip(static, inputs, strict=True):
                s.copy_(t)
            graph.replay()
            eager = _step(ctx, *inputs, w13, w2, gy)
            same.append(all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True)))
        out["same"] = same
        out["nonzero"] = all(bool(t.abs().sum() > 0) for t in captured)
        out["depth"] = ctx.stats()["activations"]["slot_depth"]
        del graph
    return out


@pytest.mark.gpu
def test_nccl_training_step_captures_in_one_cuda_graph():
    for r in dm.launch(_capture_rank, 1, device="cuda", gpus=[0], timeout=600):
        assert r["transport"] == "nccl"
        assert r["nonzero"] and all(r["same"]), r["same"]
        assert r["depth"] == [0] * len(r["depth"])


@pytest.mark.gpu
@pytest.mark.parametrize("EP, node_size", [(2, 1), (4, 2)])
def test_hierarchical_with_ranks_sharing_one_gpu(EP, node_size):
    """Issue 61's one-GPU case: ranks sharing the GPU as nodes (CUDA IPC inside a "node",
    the group's gloo backend between nodes), forward and every gradient against the
    reference, as the CPU test checks them."""
    from test_transport_nccl import _nccl_rank, check_against_reference

    seed = 950 + EP
    per_rank = dm.launch(_nccl_rank, EP, device="cuda", gpus=[0], timeout=600,
                         args=(seed, "hierarchical", node_size, "cuda"))
    check_against_reference(per_rank, seed, "hierarchical", EP, node_size)
