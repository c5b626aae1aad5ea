"""A 1F1B schedule over two local pipeline stages, its slots selected with device tensors,
captured whole in one CUDA graph (issue 62, item 3): the replay gives the eager gradients bit
for bit, and replays again with a different slot assignment written into the device table
(the same gradients: a backward follows its forward's snapshot, and where a layer's state
lies does not change its values). EP = 1 and EP = 2 as ranks sharing one GPU."""

import pytest
import torch
from test_slot_selection import MICROBATCHES, STAGES, _cfg, _problems, schedule

import distmoe as dm
from distmoe.reference import RankInputs

DIMS = dict(T=64, D=256, F=128, E=16, K=4)  # GPU tile-friendly sizes


def _run(ctx, problems, order, owner_index, table, ws, gys):
    """The schedule, each forward selecting ``table[owner_index[stage, mb]]`` on the device;
    returns the first stage's input gradients and the weights' accumulated gradients."""
    xs, ys, grads = {}, {}, {}
    for act in order:
        s, m = act.stage, act.microbatch
        p = problems[s][m]
        if act.kind == "F":
            i = owner_index[s, m]
            ctx.select_slot(table[i:i + 1])
            x = (p.x if s == 0 else ys[s - 1, m].detach()).clone().requires_grad_(True)
            xs[s, m] = x
            ys[s, m] = ctx(x, p.expert_ids, p.scores, *ws[s])
        else:
            gy = gys[m] if s == STAGES - 1 else xs[s + 1, m].grad
            ys[s, m].backward(gy)
            grads[s, m] = xs[s, m].grad
            del ys[s, m]
    return [grads[0, m] for m in range(MICROBATCHES)] + [w.grad for pair in ws for w in pair]


def _graph_rank(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    problems = [[RankInputs(*(t.to(dev) for t in (p.x, p.expert_ids, p.scores, p.w13, p.w2)))
                 for p in stage] for stage in _problems(rank, world, 11, DIMS)]
    order, slot_of, num_slots = schedule()
    owners = sorted(slot_of)
    owner_index = {o: i for i, o in enumerate(owners)}
    table = torch.tensor([slot_of[o] for o in owners], device=dev)
    swapped = torch.tensor([num_slots - 1 - slot_of[o] for o in owners], device=dev)
    gys = [problems[-1][m].x.flip(0) * 0.5 for m in range(MICROBATCHES)]
    out = {}
    with dm.MoEContext(_cfg(world, num_slots, dims=DIMS), device=dev) as ctx:
        ws = [tuple(t.clone().requires_grad_(True) for t in (stage[0].w13, stage[0].w2))
              for stage in problems]

        def zero_grads():
            for pair in ws:
                for w in pair:
                    if w.grad is None:
                        w.grad = torch.zeros_like(w)
                    else:
                        w.grad.zero_()

        zero_grads()
        eager = [t.clone() for t in _run(ctx, problems, order, owner_index, table, ws, gys)]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture wants
            zero_grads()
            _run(ctx, problems, order, owner_index, table, ws, gys)
        torch.cuda.current_stream(dev).wait_stream(side)
        zero_grads()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _run(ctx, problems, order, owner_index, table, ws, gys)
        results = []
        for label, assignment in (("same", table.clone()), ("swapped", swapped),
                                  ("same_again", table.clone())):
            table.copy_(assignment)
            zero_grads()
            graph.replay()
            torch.cuda.synchronize(dev)
            results.append((label, all(torch.equal(a, b) for a, b in zip(captured, eager,
                                                                           strict=True))))
        out["results"] = results
        out["nonzero"] = all(bool(t.abs().sum() > 0) for t in eager)
        stats = ctx.stats()["activations"]
        out["left"] = (stats["slot_depth"], stats["slot_errors"])
        out["num_slots"] = num_slots
        del graph
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("EP", [1, 2])
def test_1f1b_in_one_cuda_graph_follows_device_selections(EP):
    for r in dm.launch(_graph_rank, EP, device="cuda", gpus=[0], timeout=600):
        assert r["nonzero"]
        for label, same in r["results"]:
            assert same, label
        assert r["left"] == ([0] * r["num_slots"], [0, 0, 0, 0]), r["left"]
