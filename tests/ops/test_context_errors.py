"""MoEContext: bad input is refused before any buffer is touched; the receive bound is
enforced (overflowing routes are counted and never written); close() is idempotent."""

import pytest
import torch

import distmoe as dm

D, F, E, K, T = 32, 32, 4, 2, 8


def _inputs():
    x = torch.randn(T, D).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    scores = torch.rand(T, K)
    w13 = torch.randn(E, 2, F, D).bfloat16() / 8
    w2 = torch.randn(E, D, F).bfloat16() / 8
    return x, ids, scores, w13, w2


def _bad_inputs_rank(rank, world):
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       training=False, row_block=16)
    ctx = dm.MoEContext(cfg, device="cpu", check=True)
    good = _inputs()
    dispatch = ctx.heap.local("dispatch").clone()
    routing = ctx.heap.local("routing").clone()
    cases = {
        "x dtype": (good[0].float(),) + good[1:],
        "x width": (torch.randn(T, D + 8).bfloat16(),) + good[1:],
        "too many tokens": (torch.randn(T + 1, D).bfloat16(), torch.zeros(T + 1, K, dtype=torch.long),
                            torch.zeros(T + 1, K), *good[3:]),
        "ids float": (good[0], good[1].float(), *good[2:]),
        "ids shape": (good[0], good[1][:, :1].contiguous(), *good[2:]),
        # a transposed view of the wrong shape: the shape is reported, not the layout
        "scores shape": (*good[:2], good[2].t(), *good[3:]),
        "scores int": (*good[:2], good[2].long(), *good[3:]),
        "w13 shape": (*good[:3], good[3][:, :, :F - 8].contiguous(), good[4]),
        "w2 dtype": (*good[:4], good[4].float()),
        "non-contiguous x": (good[0].t().contiguous().t(),) + good[1:],
        "id out of range": (good[0], good[1].masked_fill(good[1] == 0, E), *good[2:]),
        "score on inactive": (good[0], good[1].masked_fill(good[1] == 0, -1), *good[2:]),
    }
    msgs = {}
    for name, args in cases.items():
        try:
            ctx(*args)
        except (ValueError, TypeError) as exc:
            msgs[name] = f"{type(exc).__name__}: {exc}"
    untouched = torch.equal(dispatch, ctx.heap.local("dispatch")) and \
        torch.equal(routing, ctx.heap.local("routing"))
    ctx.close()
    ctx.close()
    try:
        ctx(*good)
    except RuntimeError as exc:
        msgs["closed"] = str(exc)
    return msgs, untouched


def _together_rank(rank, world, case):
    """check=True at EP=2: rank 1 sends a wrong token count or a bad x; both ranks must raise
    (no rank left waiting at a barrier), with nothing published."""
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       training=False, row_block=16)
    with dm.MoEContext(cfg, device="cpu", check=True) as ctx:
        x, ids, scores, w13, w2 = _inputs()
        w13, w2 = w13[:E // world].contiguous(), w2[:E // world].contiguous()
        if rank == 1 and case == "tokens":
            x, ids, scores = x[:T - 1], ids[:T - 1], scores[:T - 1]
        if rank == 1 and case == "dtype":
            x = x.float()
        routing = ctx.heap.local("routing").clone()
        try:
            ctx(x, ids, scores, w13, w2)
            err = None
        except (TypeError, ValueError) as exc:
            err = f"{type(exc).__name__}: {exc}"
        untouched = torch.equal(routing, ctx.heap.local("routing"))
        # the group still works: a good call on both ranks afterwards
        y = ctx(*_inputs()[:3], w13, w2)
    return err, untouched, tuple(y.shape)


@pytest.mark.parametrize("case", ["tokens", "dtype"])
def test_check_mode_makes_every_rank_raise_together(case):
    (e0, u0, y0), (e1, u1, y1) = dm.launch(_together_rank, 2, args=(case,))
    assert u0 and u1 and y0 == y1 == (T, D)
    if case == "tokens":
        want = f"ValueError: x must have the same number of tokens T on every rank of the group, got T = [{T}, {T - 1}]"
        assert e0.startswith(want) and e1.startswith(want), (e0, e1)
    else:
        assert e1.startswith("TypeError: x must be torch.bfloat16"), e1
        assert e0.startswith("ValueError: rank 1 refused its input (TypeError: x must be "
                             "torch.bfloat16"), e0


def _unchecked_tokens_rank(rank, world):
    """check=False at EP=2: a call where rank 1 has one token fewer, then a good one. Returns
    this rank's token-count mismatch counter after each."""
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       training=False, row_block=16)
    with dm.MoEContext(cfg, device="cpu") as ctx:
        x, ids, scores, w13, w2 = _inputs()
        w13, w2 = w13[:E // world].contiguous(), w2[:E // world].contiguous()
        n = T - 1 if rank == 1 else T
        ctx(x[:n], ids[:n], scores[:n], w13, w2)
        first = ctx.stats()["token_count_mismatches"]
        ctx(x, ids, scores, w13, w2)
        second = ctx.stats()
    return first, second["token_count_mismatches"], second["calls"]


def test_unchecked_token_count_mismatch_is_counted_on_every_rank():
    # unchecked, nothing refuses the call, but every rank counts it (stats), and a later good
    # call adds nothing
    assert dm.launch(_unchecked_tokens_rank, 2) == [(1, 1, 2), (1, 1, 2)]


def test_bad_inputs_raise_before_buffers_are_touched():
    msgs, untouched = dm.launch(_bad_inputs_rank, 1)[0]
    assert untouched
    expected = {
        "x dtype": r"TypeError: x must be torch.bfloat16, got torch.float32",
        # shapes name the config field each width comes from
        "x width": r"x must be \[T, hidden=32\], got \(8, 40\)",
        "too many tokens": r"x has T = 9 tokens, above max_tokens \(8\)",
        "ids float": r"TypeError: expert_ids must have an integer dtype",
        "ids shape": r"expert_ids must be \[T, top_k\] = \[8, 2\] \(T from x\), got \(8, 1\)",
        "scores shape": r"scores must be \[T, top_k\] = \[8, 2\] \(T from x\), got \(2, 8\)",
        "scores int": r"TypeError: scores must have a floating dtype \(float32, bfloat16, "
                      r"float16, float64\), got torch.int64",
        "w13 shape": r"w13 must be \[E_local=4, 2, ffn=32, hidden=32\] \(gate = w13\[e, 0\]",
        "w2 dtype": r"TypeError: w2 must be torch.bfloat16",
        "non-contiguous x": r"x must be contiguous, got shape \(8, 32\) with strides \(1, 8\)",
        "id out of range": r"expert_ids must lie in \[-1, num_experts=4\); found 4 at \[\d+, \d+\]",
        "score on inactive": r"scores must be 0 on inactive routes",
        "closed": r"this MoEContext is closed",
    }
    import re

    for name, pattern in expected.items():
        assert name in msgs, f"{name}: no error raised"
        assert re.search(pattern, msgs[name]), (name, msgs[name])


def _overflow_rank(rank, world, check, device="cpu"):
    # Everyone routes everything to rank 0's experts; rank 0's bound is half its load.
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
    T2 = 32
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T2,
                       training=False, row_block=16, device_scratch_factor=0.5)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T2, D, generator=g).bfloat16()
    ids = torch.tensor([[0, 1]] * T2)
    scores = torch.rand(T2, K, generator=g)
    w13 = torch.randn(E // world, 2, F, D, generator=g).bfloat16() / 8
    w2 = torch.randn(E // world, D, F, generator=g).bfloat16() / 8
    x, ids, scores, w13, w2 = (t.to(dev) for t in (x, ids, scores, w13, w2))
    with dm.MoEContext(cfg, device=dev, check=check) as ctx:
        # canaries: every heap buffer and the scratch beyond R_cap must keep their bytes
        h2_before = ctx._h2.clone()
        combine = ctx.heap.view("combine", rank, torch.bfloat16, (T2 * K, D))
        combine.fill_(1234.0)
        ctx.heap.barrier()
        try:
            y = ctx(x, ids, scores, w13, w2)
            err = None
        except RuntimeError as exc:
            y, err = None, str(exc)
        stats = ctx.stats()
        ctx.heap.barrier()
        untouched_slots = int((combine == 1234.0).all(1).sum())
        return dict(stats=stats, err=err, untouched_slots=untouched_slots,
                    h2_shape_same=ctx._h2.shape == h2_before.shape,
                    y=None if y is None else y.cpu())


@pytest.mark.parametrize("check", [False, True])
def test_receive_bound_overflow_is_counted_and_never_written(check):
    _check_overflow(dm.launch(_overflow_rank, 2, args=(check,)), check)


@pytest.mark.gpu
@pytest.mark.parametrize("check", [False, True])
def test_receive_bound_overflow_on_one_gpu(check):
    """The same at EP=2 with both ranks on one GPU (CUDA IPC heap): the device-side bound,
    the drop count and, with check=True, the collective raise after the call."""
    _check_overflow(dm.launch(_overflow_rank, 2, args=(check, "cuda"), device="cuda",
                              gpus=[0], timeout=300), check)


def _check_overflow(out, check):
    r0, r1 = out
    s = r0["stats"]
    # rank 0 receives 2 ranks x 32 tokens x 2 routes = 128 rows; bound = 0.5 * 32 * 2 = 32
    assert s["last_recv_rows"] == 128 and s["receive_bound"] == 32
    # EP=2: tokens of both ranks (D bf16 + an int8 flag each), the pointer table and, per
    # 128-row block, W13's int8 peer flag, int32 position and int8 expert start (one more
    # start, and 4 int32 bounds)
    rc = s["row_capacity"]
    order = rc // 128 * 6 + 1 + 16 if rc % 128 == 0 else 0
    assert s["pull_buffer_bytes"] == 2 * 32 * (D * 2 + 1) + rc * 8 + order  # T_max 32
    assert s["dropped_rows"] == 128 - s["receive_bound"]  # exactly the bound's rows run
    assert r1["stats"]["last_recv_rows"] == 0
    # every dropped route's return slot kept its canary on its owner
    assert r0["untouched_slots"] + r1["untouched_slots"] == s["dropped_rows"]
    if check:
        assert r0["err"] is not None and "rank 0 received 128 rows, above its receive bound of 32" in r0["err"]
        # every rank raises (a rank left alone would wait in the next collective)
        assert r1["err"] is not None and r1["err"].startswith(
            "rank 0 failed the check after the call (RuntimeError: rank 0 received 128 rows")
    else:
        assert r0["err"] is None and r0["y"] is not None and torch.isfinite(r0["y"].float()).all()


def _narrow_rank(rank, world):
    cfg = dm.MoEConfig(hidden=16, ffn=2048, num_experts=E, top_k=K, max_tokens=T,
                       training=True, row_block=16)
    try:
        dm.MoEContext(cfg, device="cpu")
    except ValueError as exc:
        return str(exc)
    return None


def test_training_refuses_a_hidden_width_too_narrow_for_the_score_parts():
    """Training carries each route's score and its gradient parts (one per W2 DGRAD column
    tile) as fp32 values in the route's bf16 combine row: D = 16 holds 8, F = 2048 needs
    more. Refused at construction, naming both widths."""
    msg = dm.launch(_narrow_rank, 1)[0]
    assert msg is not None and "hidden = 16" in msg and "ffn = 2048" in msg, msg
