"""``MoEContext(..., transport="nccl" | "hierarchical")`` (distmoe.ops.transport) on CPU
ranks, with gloo standing in for NCCL: the layer over all-gather / reduce-scatter collectives
around a one-rank context per rank ("nccl", EP 2, 3 and 4) or a peer-memory context per
"node" (4 ranks as 2 nodes of 2, ``node_size=2``: the CPU shared-memory heap inside a node,
gloo between), against torch autograd of the reference, forward and every gradient, with
skewed routing, inactive routes and a rank that receives no rows.

Tolerance: test_training's rule (our max abs error against the fp64 oracle at most twice the
bf16 reference's, plus 1/128 of the largest fp64 value). The transport rounds y twice (each
rank's partial sum to bf16 inside its one-rank layer, then the fp32 sum of the partials), so
its error can exceed the peer path's by one bf16 rounding of a partial sum, which the floor
covers (a partial is at most the whole sum in magnitude; 2^-9 of it is below 1/128).
"""

import pytest
import torch
from forward_cases import make_problem
from test_training import _check, _compare, _ref_grads, _upstream

import distmoe as dm
from distmoe.reference import moe_reference, split_global_problem

D, F, T, E, K = 32, 32, 12, 12, 2
CASES = ("balanced", "imbalance_8x", "inactive_mix", "zero_live_tokens_on_last_rank")


def _cfg(world, training=True):
    # experts divisible by 2, 3 and 4; a receive bound that never drops (every gradient
    # compared with the reference's)
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=training, row_block=16, device_scratch_factor=float(world),
                        max_layers_per_slot=2)


def _on(device, p):
    return type(p)(*(t.to(device) for t in (p.x, p.expert_ids, p.scores, p.w13, p.w2)))


def _nccl_rank(rank, world, seed, transport, node_size, device="cpu"):
    out = {}
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    kw = dict(transport=transport, node_size=node_size, device=device)
    with dm.MoEContext(_cfg(world), **kw) as ctx, \
            dm.MoEContext(_cfg(world, training=False), **kw) as inf:
        out["transport"] = (ctx.transport, ctx.stats()["transport"], inf.transport)
        out["explain"] = ctx.explain().splitlines()[0]
        for i, name in enumerate(CASES):
            p = _on(device, split_global_problem(*make_problem(seed + i, world, T, D, F, E, K,
                                                               name), world)[rank])
            gy = _upstream(seed + i, world * T)[rank * T:(rank + 1) * T].to(device)
            leaves = [t.clone().requires_grad_(True) for t in (p.x, p.scores, p.w13, p.w2)]
            y = ctx(leaves[0], p.expert_ids, *leaves[1:])
            (y.float() * gy).sum().backward()
            out[name] = [y.detach().cpu()] + [t.grad.cpu() for t in leaves]
            with torch.no_grad():
                out[name + " inference"] = inf(p.x, p.expert_ids, p.scores, p.w13,
                                               p.w2).cpu()
        out["depth"] = ctx.stats()["activations"]["slot_depth"]
        # ids outside [-1, E) on every rank: never executed (y as with those routes
        # inactive), counted once per rank of the group the ids are gathered over
        before = inf.stats()["invalid_ids"]
        p = _on(device, split_global_problem(*make_problem(seed, world, T, D, F, E, K,
                                                           "balanced"), world)[rank])
        bad = p.expert_ids.clone()
        bad[0, 0], bad[1, 1] = E + 3, -5
        inactive = bad.clone()
        inactive[0, 0], inactive[1, 1] = -1, -1
        with torch.no_grad():
            out["invalid y"] = (inf(p.x, bad, p.scores, p.w13, p.w2).cpu(),
                                inf(p.x, inactive, p.scores, p.w13, p.w2).cpu())
        out["invalid count"] = inf.stats()["invalid_ids"] - before
    return out


@pytest.mark.parametrize("transport, EP, node_size", [
    ("nccl", 2, None), ("nccl", 3, None), ("nccl", 4, None), ("hierarchical", 4, 2)])
def test_collective_transports_match_the_reference(transport, EP, node_size):
    seed = 900 + EP
    per_rank = dm.launch(_nccl_rank, EP, args=(seed, transport, node_size), timeout=600)
    check_against_reference(per_rank, seed, transport, EP, node_size)


def check_against_reference(per_rank, seed, transport, EP, node_size):
    """Every rank's outputs and gradients (:func:`_nccl_rank`) against the reference."""
    for r in per_rank:
        assert r["transport"] == (transport,) * 3
        assert r["explain"].startswith(f"transport: {transport}")
        assert r["depth"] == [0] * len(r["depth"])
        assert torch.equal(*r["invalid y"])
        assert r["invalid count"] == 2 * (EP // (node_size or 1))
    for i, name in enumerate(CASES):
        x, ids, scores, w13, w2 = make_problem(seed + i, EP, T, D, F, E, K, name)
        gy = _upstream(seed + i, EP * T)
        f64 = [x.double(), ids, scores.double(), w13.double(), w2.double()]
        y64, g64 = _ref_grads(moe_reference, f64, gy.double())
        y16, g16 = _ref_grads(moe_reference, [x, ids, scores, w13, w2], gy)
        outs = [r[name] for r in per_rank]
        _check(f"{name} y", torch.cat([o[0] for o in outs]), y64, y16)
        _check(f"{name} y (inference)", torch.cat([r[name + " inference"]
                                                   for r in per_rank]), y64, y16)
        # grads: x, scores (per token), w13, w2 (per expert)
        _compare(name, [o[1:] for o in outs], [g64[0], g64[1], g64[2], g64[3]],
                 [g16[0], g16[1], g16[2], g16[3]], expert_slots={2, 3})


def _errors_rank(rank, world):
    msgs = []
    for transport in ("bogus", 3):
        try:
            dm.MoEContext(_cfg(world), transport=transport)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    with dm.MoEContext(_cfg(world), transport="auto") as ctx:  # one host: peer memory
        msgs.append(ctx.transport)
    for transport, node_size in (("hierarchical", 3), ("nccl", 2)):
        try:
            dm.MoEContext(_cfg(world), transport=transport, node_size=node_size)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    with dm.MoEContext(_cfg(world, training=False), transport="nccl") as ctx:
        try:
            ctx.input_buffer(4)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
        p = split_global_problem(*make_problem(5, world, T, D, F, E, K, "balanced"),
                                 world)[rank]
        try:
            ctx(p.x, p.expert_ids, p.scores, p.w13[:1], p.w2)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def test_nccl_transport_errors():
    for msgs in dm.launch(_errors_rank, 2, timeout=300):
        assert msgs[0].startswith("transport ('bogus') must be one of ('auto', 'peer', "
                                  "'nccl', 'hierarchical')"), msgs[0]
        assert msgs[1].startswith("transport (3) must be one of")
        assert msgs[2] == "peer"
        assert msgs[3] == "node_size (3) must divide the group size (2)", msgs[3]
        assert msgs[4] == "node_size (2) is for transport='hierarchical', got transport='nccl'"
        assert msgs[5].startswith("input_buffer is for the peer transport")
        assert msgs[6].startswith("w13 must be [E_local=6, 2, ffn=32, hidden=32]"), msgs[6]
