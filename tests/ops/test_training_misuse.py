"""Training misuse that used to pass silently or hang, on CPU ranks: tensors changed in place
between a layer's forward and backward, double backward, and in ``check`` mode a receive-bound
overflow on one rank (every rank must raise, the lost layer must leave its slot), repeated
expert ids in a token and ranks that disagree about taking the autograd path."""

import pytest
import torch

import distmoe as dm
from distmoe.reference import split_global_problem

D, F, E, K, T = 32, 32, 4, 2, 12


def _problem(world, ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = world * T
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    scores = torch.rand(n, K, generator=g) + 0.1
    x = torch.randn(n, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    return split_global_problem(x, ids, scores, w13, w2, world)


def _cfg(world, **kw):
    base = dict(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, row_block=16,
                device_scratch_factor=float(world))
    base.update(kw)
    return dm.MoEConfig(**base)


def _inplace_rank(rank, world, what):
    p = _problem(world)[rank]
    out = {}
    with dm.MoEContext(_cfg(world), device="cpu") as ctx:
        x = p.x.clone().requires_grad_(True)
        scores = p.scores.clone().requires_grad_(True)
        w13 = p.w13.clone().requires_grad_(True)
        w2 = p.w2.clone().requires_grad_(True)
        y = ctx(x, p.expert_ids, scores, w13, w2)
        if what == "double":
            (gx,) = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
            try:
                gx.float().square().sum().backward()
                out["error"] = None
            except RuntimeError as exc:
                out["error"] = str(exc)
            return out
        with torch.no_grad():
            {"w2": w2, "w13": w13, "scores": scores}[what].mul_(2)
        try:
            y.float().sum().backward()
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = str(exc)
        out["depth"] = ctx.stats()["activations"]["slot_depth"]
        with pytest.raises(RuntimeError, match="still owned by a backward"):
            ctx.reset_slots()  # y's graph can still run the backward
        del y
        ctx.reset_slots()
    return out


@pytest.mark.parametrize("what", ["w2", "w13", "scores"])
def test_in_place_change_before_backward_raises(what):
    # the gradients used to mix the old and the new values without a word
    out = dm.launch(_inplace_rank, 1, args=(what,))[0]
    assert out["error"] is not None and out["error"].startswith(
        f"MoE layer backward: {what} was modified in place after the layer's forward"), out


def test_double_backward_raises():
    # create_graph=True used to give a grad_x without a graph: second-order terms lost
    out = dm.launch(_inplace_rank, 1, args=("double",))[0]
    assert out["error"] is not None and "once_differentiable" in out["error"], out


def _overflow_rank(rank, world):
    n = world * T
    ids = torch.stack([torch.tensor([0, 1])] * n)  # every route to rank 0's two experts
    p = _problem(world, ids)[rank]
    out = {}
    # bound T*K = 24 rows per rank; rank 0 receives 2 * 24
    with dm.MoEContext(_cfg(world, device_scratch_factor=1.0), device="cpu",
                       check=True) as ctx:
        w13 = p.w13.clone().requires_grad_(True)
        try:
            y = ctx(p.x, p.expert_ids, p.scores, w13, p.w2)
            y.float().sum().backward()
            out["error"] = None
        except (RuntimeError, ValueError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["depth"] = ctx.stats()["activations"]["slot_depth"]
        # the group still works, and an earlier overflow is not reported again
        q = _problem(world, seed=1)[rank]
        y = ctx(q.x, q.expert_ids, q.scores, q.w13.clone().requires_grad_(True), q.w2)
        y.float().sum().backward()
        out["after"] = ctx.stats()["activations"]["slot_depth"]
    return out


def test_check_mode_overflow_stops_every_rank_and_frees_the_slot():
    # only the overflowing rank raised; its peer went into the collective backward and hung,
    # and the lost layer stayed in the overflowing rank's slot
    r0, r1 = dm.launch(_overflow_rank, 2, timeout=240)
    assert r0["error"].startswith("RuntimeError: rank 0 received 48 rows, above its receive "
                                  "bound of 24 rows"), r0
    assert r1["error"].startswith("RuntimeError: rank 0 failed the check after the call"), r1
    assert r0["depth"] == r1["depth"] == [0] and r0["after"] == r1["after"] == [0]


def _check_inputs_rank(rank, world, case):
    p = _problem(world)[rank]
    ids = p.expert_ids.clone()
    w13 = p.w13.clone()
    if case == "repeated id":
        ids[3] = ids[3, 0]
    if case == "paths" and rank == 1:
        w13.requires_grad_(True)  # experts trained on rank 1 only
    with dm.MoEContext(_cfg(world), device="cpu", check=True) as ctx:
        calls = ctx.stats()["calls"]
        try:
            ctx(p.x, ids, p.scores, w13, p.w2)
            err = None
        except ValueError as exc:
            err = str(exc)
        return err, ctx.stats()["calls"] == calls


def test_check_mode_refuses_a_repeated_expert_in_a_token():
    (err, untouched), = dm.launch(_check_inputs_rank, 1, args=("repeated id",))
    assert untouched and err is not None and err.startswith(
        "expert_ids must name distinct experts per token"), err
    assert "token 3 names expert" in err


def test_check_mode_refuses_ranks_on_different_paths():
    # rank 0 would take the inference path and rank 1 the collective autograd one: a hang
    out = dm.launch(_check_inputs_rank, 2, args=("paths",), timeout=240)
    for err, untouched in out:
        assert untouched and err is not None and err.startswith(
            "every rank must take the same path, autograd or not"), err
        assert "autograd = [False, True]" in err
