"""Eager inference calls replayed from the context's own CUDA graphs (distmoe.ops.graphs):
the same bits as eager calls, new inputs every call, several token counts and weights."""

import pytest
import torch
from forward_cases import make_problem, split_global_problem

import distmoe as dm

D, F, E, K = 256, 128, 16, 4


def _graphs_rank(rank, world, Ts):
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=max(Ts),
                       training=False, device_scratch_factor=float(world))
    out = []
    with dm.MoEContext(cfg, device=dev) as fast, \
            dm.MoEContext(cfg, device=dev, graphs=False) as slow:
        assert fast.graphs is not None and slow.graphs is None
        layers = [split_global_problem(*make_problem(100 + i, world, max(Ts), D, F, E, K,
                                                     "inactive_mix"), world)[rank]
                  for i in range(2)]
        weights = [(lay.w13.to(dev), lay.w2.to(dev)) for lay in layers]  # two layers' weights
        for step in range(3):
            for T in Ts:
                for i, (w13, w2) in enumerate(weights):
                    # fresh inputs every call (never the captured ones)
                    p = split_global_problem(*make_problem(1000 * step + 10 * T + i, world,
                                                           T, D, F, E, K, "inactive_mix"),
                                             world)[rank]
                    args = [t.to(dev) for t in (p.x, p.expert_ids, p.scores)] + [w13, w2]
                    y_fast = fast(*args)
                    y_slow = slow(*args)
                    out.append((step, T, i, torch.equal(y_fast, y_slow),
                                bool(torch.isfinite(y_fast.float()).all())))
        stats = fast.graphs.stats()
    return out, stats


@pytest.mark.gpu
@pytest.mark.parametrize("EP", [1, 2])
def test_graphed_eager_calls_give_the_eager_bits(EP):
    Ts = (64, 200)
    for out, stats in dm.launch(_graphs_rank, EP, device="cuda", gpus=[0], timeout=300,
                                args=(Ts,)):
        for step, T, layer, same, finite in out:
            assert finite and same, (step, T, layer)
        keys = len(Ts) * 2  # token counts x layers
        # first call of a key eager, second captures and replays, third replays
        assert stats["captures"] == keys and stats["replays"] == 2 * keys, stats


def test_graphs_argument_is_checked_and_off_on_cpu():
    cfg = dm.MoEConfig(hidden=64, ffn=32, num_experts=4, top_k=2, max_tokens=8,
                       training=False, row_block=16)
    with pytest.raises(TypeError, match=r"graphs must be a bool, got int \(1\)"):
        dm.MoEContext(cfg, device="cpu", graphs=1)
