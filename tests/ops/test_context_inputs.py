"""MoEContext input edge cases: expert ids beyond the int16 routing buffer, unsigned ids in
check mode, T = 0, and the constructor's own arguments. One CPU rank (gloo), interpreter
kernels, tiny shapes."""

import pytest
import torch

import distmoe as dm

D, F, E, K, T = 32, 32, 4, 2, 8


def _inputs(seed=0, training=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    scores = torch.rand(T, K, generator=g)
    w13 = torch.randn(E, 2, F, D, generator=g).bfloat16() / 8
    w2 = torch.randn(E, D, F, generator=g).bfloat16() / 8
    if training:
        x, scores, w13, w2 = (t.requires_grad_(True) for t in (x, scores, w13, w2))
    return x, ids, scores, w13, w2


def _cfg(training):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=training, row_block=16)


def _wide_ids_rank(rank, world, training):
    """Unchecked: ids beyond int16 (which a plain copy into the int16 routing buffer would wrap
    into valid ones) against the same call with those routes made inactive. Returns, per bad
    value, (y bits equal, grads bits equal, invalid ids counted)."""
    ctx = dm.MoEContext(_cfg(training), device="cpu")
    out = {}
    for value in (65537, 2**32 + 3, 65535, -65535, 2**40):
        x, ids, scores, w13, w2 = _inputs(1, training)
        bad = ids == 0
        before = ctx.stats()["invalid_ids"]
        y = ctx(x, ids.masked_fill(bad, value), scores, w13, w2)
        counted = ctx.stats()["invalid_ids"] - before
        grads = None
        if training:
            y.float().square().sum().backward()
            grads = [t.grad.clone() for t in (x, w13, w2)]
        x2, ids2, scores2, w13b, w2b = _inputs(1, training)
        with torch.no_grad():
            scores2.masked_fill_(bad, 0.0)
        y2 = ctx(x2, ids2.masked_fill(bad, -1), scores2, w13b, w2b)
        same_grads = True
        if training:
            y2.float().square().sum().backward()
            same_grads = all(torch.equal(a, b.grad) for a, b in zip(grads, (x2, w13b, w2b),
                                                                       strict=True))
        out[value] = (torch.equal(y, y2), same_grads, counted, int(bad.sum()))
    ctx.close()
    return out


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_ids_beyond_int16_are_dropped_and_counted(training):
    # each such route is an invalid id: not run (y and the gradients are those of the route
    # made inactive, bit for bit), counted in stats()["invalid_ids"]; before the clamp they
    # wrapped into valid experts, and a training backward wrote out of bounds
    out = dm.launch(_wide_ids_rank, 1, args=(training,))[0]
    for value, (same_y, same_grads, counted, want) in out.items():
        assert want > 0
        assert same_y and same_grads and counted == want, (value, out[value])


def _check_mode_rank(rank, world):
    ctx = dm.MoEContext(_cfg(False), device="cpu", check=True)
    x, ids, scores, w13, w2 = _inputs(2)
    y = ctx(x, ids.to(torch.uint8), scores, w13, w2)  # valid unsigned ids are accepted
    y_ref = ctx(x, ids, scores, w13, w2)
    msgs = []
    routing = ctx.heap.local("routing").clone()
    bad_ids = ids.to(torch.uint8)
    bad_ids[3, 1] = 200
    bad_scores = scores.clone()
    bad_scores[5, 0] = 0.25
    for args in ((x, bad_ids, scores, w13, w2),
                 (x, ids.masked_fill(torch.arange(T)[:, None] == 5, -1), bad_scores, w13, w2)):
        try:
            ctx(*args)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    untouched = torch.equal(routing, ctx.heap.local("routing"))
    ctx.close()
    return torch.equal(y, y_ref), msgs, untouched


def test_check_mode_reads_unsigned_ids_and_names_the_offending_entry():
    same, msgs, untouched = dm.launch(_check_mode_rank, 1)[0]
    assert same and untouched
    assert msgs[0] == "expert_ids must lie in [-1, num_experts=4); found 200 at [3, 1]", msgs[0]
    assert msgs[1] == "scores must be 0 on inactive routes (expert id -1); found 0.25 at [5, 0]", \
        msgs[1]


def _empty_rank(rank, world):
    out = {}
    with dm.MoEContext(_cfg(True), device="cpu") as ctx:
        x, ids, scores, w13, w2 = _inputs(3, training=True)
        calls = ctx.stats()["calls"]
        try:
            ctx(x[:0], ids[:0], scores[:0], w13, w2)
            out["training"] = None
        except ValueError as exc:
            out["training"] = str(exc)
        out["calls unchanged"] = ctx.stats()["calls"] == calls
        with torch.no_grad():  # no autograd: an empty y
            out["no_grad"] = tuple(ctx(x[:0], ids[:0], scores[:0], w13, w2).shape)
    return out


def test_empty_training_forward_is_refused_before_anything_is_published():
    out = dm.launch(_empty_rank, 1)[0]
    assert out["training"] is not None and out["training"].startswith(
        "x has T = 0 tokens: a training forward under autograd needs T >= 1"), out
    assert out["calls unchanged"]
    assert out["no_grad"] == (0, D)


def _constructor_rank(rank, world):
    msgs = {}
    for name, kwargs in {"check str": dict(device="cpu", check="no"),
                         "meta device": dict(device="meta"),
                         "bad device": dict(device="tpu:0")}.items():
        try:
            dm.MoEContext(_cfg(False), **kwargs).close()
            msgs[name] = None
        except (TypeError, ValueError) as exc:
            msgs[name] = f"{type(exc).__name__}: {exc}"
    return msgs


def test_constructor_refuses_a_non_bool_check_and_other_devices():
    msgs = dm.launch(_constructor_rank, 1)[0]
    assert msgs["check str"] == "TypeError: check must be a bool, got str ('no')", msgs
    assert msgs["meta device"] == ("ValueError: device ('meta') must be a CPU or CUDA device, "
                                   "got device type 'meta'"), msgs
    assert msgs["bad device"] is not None and msgs["bad device"].startswith(
        "ValueError: device ('tpu:0')"), msgs


def _inference_grad_rank(rank, world):
    import warnings

    with dm.MoEContext(_cfg(False), device="cpu") as ctx:
        x, ids, scores, w13, w2 = _inputs(4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx(x, ids, scores, w13, w2)  # nothing requires grad: silent
            quiet = len(caught)
            y = ctx(x.requires_grad_(True), ids, scores, w13, w2)
            with torch.no_grad():
                ctx(x, ids, scores, w13, w2)  # no_grad: silent
        return quiet, [str(w.message) for w in caught], y.grad_fn is None


def test_inference_context_warns_when_its_inputs_require_grad():
    quiet, msgs, no_grad_fn = dm.launch(_inference_grad_rank, 1)[0]
    assert quiet == 0 and no_grad_fn
    assert len(msgs) == 1 and msgs[0].startswith(
        "MoEContext: x or scores requires grad, but this is an inference context"), msgs


def _two_contexts_rank(rank, world):
    from distmoe.reference import split_global_problem

    cfg = _cfg(False)
    x, ids, scores, w13, w2 = _inputs(5)
    x, ids, scores = (torch.cat([t, t]) for t in (x, ids, scores))  # both ranks' tokens
    p = split_global_problem(x, ids, scores, w13, w2, world)[rank]
    with dm.MoEContext(cfg, device="cpu", check=True) as a, \
            dm.MoEContext(cfg, device="cpu", check=True) as b:
        first = a if rank == 0 else b  # the ranks disagree about which context comes first
        try:
            first(p.x, p.expert_ids, p.scores, p.w13, p.w2)
            return None
        except ValueError as exc:
            return str(exc)


def test_check_mode_refuses_ranks_calling_different_contexts():
    # unchecked, their barriers pair up across the two contexts: wrong results, no error
    for err in dm.launch(_two_contexts_rank, 2, timeout=240):
        assert err is not None and err.startswith(
            "the ranks called different MoEContexts in this call (context serials [1, 2]"), err
