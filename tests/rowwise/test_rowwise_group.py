"""distmoe.rowwise on CPU ranks (gloo group, the CPU shared-memory heap, kernels in Triton's
interpreter), EP 1 to 4: one launch per group size runs every scenario, and the tests below
check what each rank returned against references built here from the same problem
(:mod:`rowwise_cases`).

* Movement (dispatch PUT, gather GET, and every gradient that is a movement) is compared
  bit for bit, with destinations poisoned first. Reductions (combine forward, dispatch
  backward) are compared bit for bit too, against references that sum in fp32 in the
  kernels' order (k order) and round once, the same arithmetic on the CPU.
* Probability gradients are fp32 dot products over D of bf16 values: compared with
  ``rtol = 1e-5`` (fp32 accumulation over D = 24 terms in another order: a few fp32 ulps
  of the sum of the terms' magnitudes) against fp64 dots of the same bf16 values.
* A two-op chain (weighted dispatch -> per-rank scale -> weighted combine) is checked
  against torch autograd of a plain-PyTorch reference on fp64 copies of the same bf16
  inputs (the oracle): our max abs error is at most 2x that of torch's autograd of the
  same reference in bf16 with fp32 sums (the precision the kernels work at: bf16 rows,
  fp32 reductions, one bf16 rounding per result), plus a floor of 1/128 of the largest
  oracle magnitude (results that round to neighbouring bf16 values).
"""

import functools
import re

import pytest
import torch
from rowwise_cases import POISON, assert_bits_equal, make_problem, on_device, poison_, to_cpu

import distmoe
import distmoe.rowwise as rw
from distmoe.kernels.movement.rowwise_get import rowwise_combine_get_ref, rowwise_gather_ref
from distmoe.kernels.movement.rowwise_put import rowwise_put_ref
from distmoe.rowwise.combine import combine_get_diff_ref
from distmoe.rowwise.dispatch import dispatch_put_ref

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("rowwise_group")

SEED, BAD_SEED = 5, 6
WORLDS = [1, 2, 3, 4]


def _upstream(seed: int, rows: int, hidden: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).bfloat16().to(device)


def _scale(rank: int, hidden: int, device="cpu") -> torch.Tensor:
    """The chain's per-rank "expert": an elementwise scale, bf16 [D]."""
    return _upstream(300 + rank, 1, hidden, device)[0]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _backward(y: torch.Tensor, grad_y: torch.Tensor) -> None:
    """Backward with ``grad_y`` as y's gradient, from a scalar loss (bf16 grad_y is exact
    in fp32; and a scalar backward does not import sympy as a given gradient does)."""
    (y.float() * grad_y.float()).sum().backward()


def _grad(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.grad is None else t.grad.clone()


# --------------------------------------------------------------------------------------------
# What every rank runs
# --------------------------------------------------------------------------------------------


def _movement(bufs, p, rank, res, prefix=""):
    ranks, rows, x, probs = p.ranks[rank], p.rows[rank], p.x[rank], p.probs[rank]
    poison_(bufs.out)
    bufs.barrier()  # every rank poisoned before any PUT
    rw.dispatch_put(x, ranks, rows, bufs.out)
    res[prefix + "out"] = bufs.out.clone()
    poison_(bufs.out)
    rw.dispatch_put(x, ranks, rows, bufs.out, probs, pre_barrier=True)  # the barrier in-call
    res[prefix + "out_weighted"] = bufs.out.clone()
    bufs.expert_out.copy_(p.src[rank])
    for key, fn in (("y", rw.combine_get), ("y_fused", rw.combine_get_fused)):
        res[prefix + key] = fn(bufs.expert_out, ranks, rows)  # pre-barrier: sources landed
        res[prefix + key + "_weighted"] = fn(bufs.expert_out, ranks, rows, probs)
    res[prefix + "gathered"] = rw.gather_get(bufs.expert_out, ranks.reshape(-1),
                                             rows.reshape(-1), post_barrier=True)
    res[prefix + "stats"] = bufs.stats()


def _grads(bufs, p, rank, res):
    ranks, rows = p.ranks[rank], p.rows[rank]
    hidden, num_rows = p.hidden, p.rows_per_rank
    g_out = _upstream(100 + rank, num_rows, hidden, bufs.device)
    g_y = _upstream(200 + rank, p.num_tokens[rank], hidden, bufs.device)
    # dispatch backward: a combine GET of out's gradient (weighted: probs' gradient too)
    for key, probs in (("dispatch", None), ("dispatch_weighted", _leaf(p.probs[rank]))):
        x = _leaf(p.x[rank])
        out = rw.dispatch_put(x, ranks, rows, bufs.out, probs)
        assert out is bufs.out and out.grad_fn is not None
        _backward(out, g_out)
        res[key] = (_grad(x), None if probs is None else _grad(probs))
    # combine / gather backward: a (weighted) PUT into the gradient twin of expert_out
    bufs.expert_out.copy_(p.src[rank])
    bufs.barrier()
    src = bufs.expert_out.requires_grad_(True)
    for key, fn in (("combine", rw.combine_get), ("combine_fused", rw.combine_get_fused)):
        for suffix, probs in (("", None), ("_weighted", _leaf(p.probs[rank]))):
            y = fn(src, ranks, rows, probs)
            _backward(y, g_y)
            res[key + suffix] = (_grad(src), None if probs is None else _grad(probs))
            src.grad = None
    y = rw.gather_get(src, ranks.reshape(-1), rows.reshape(-1))
    _backward(y, _upstream(400 + rank, y.shape[0], hidden, bufs.device))
    res["gather"] = (_grad(src), None)
    src.grad = None
    src.requires_grad_(False)
    # round trip through one buffer: the combine's backward PUTs into out's gradient twin,
    # then the dispatch's backward stages its own gradient there and pulls it
    x = _leaf(p.x[rank])
    out = rw.dispatch_put(x, ranks, rows, bufs.out)
    _backward(rw.combine_get(out, ranks, rows), g_y)
    res["round_trip"] = (_grad(x), None)


def _chain(bufs, p, rank, res):
    """Weighted dispatch -> per-rank scale -> weighted combine, fused and unfused."""
    for key, combine in (("chain", rw.combine_get), ("chain_fused", rw.combine_get_fused)):
        x, pd, pc = _leaf(p.x[rank]), _leaf(p.probs[rank]), _leaf(p.probs[rank] * 0.5)
        out = rw.dispatch_put(x, p.ranks[rank], p.rows[rank], bufs.out, pd)
        src = bufs.write("expert_out", out.float() * _scale(rank, p.hidden, bufs.device).float())
        y = combine(src, p.ranks[rank], p.rows[rank], pc)
        up = _upstream(500 + rank, y.shape[0], p.hidden, bufs.device)
        loss = (y.float() * up.float()).sum()
        loss.backward()
        res[key] = (y.detach().clone(), _grad(x), _grad(pd), _grad(pc))


def _scenarios(rank, world, device="cpu"):
    """Every scenario on one rank; ``device="cuda"``: ranks sharing GPU 0 through the CUDA
    IPC heap, results returned on the CPU."""
    backend = "cpu" if device == "cpu" else "auto"
    p = on_device(make_problem(world, SEED), device)
    res = {}
    with rw.Buffers(None, p.rows_per_rank, p.hidden, backend=backend) as bufs:
        _movement(bufs, p, rank, res)
        _grads(bufs, p, rank, res)
        _chain(bufs, p, rank, res)
    pb = on_device(make_problem(world, BAD_SEED, bad=True), device)
    with rw.Buffers(None, pb.rows_per_rank, pb.hidden, backend=backend, grad=False) as bufs:
        _movement(bufs, pb, rank, res, prefix="bad_")
    return to_cpu(res)


GROUPS = [pytest.param((w, "cpu"), id=f"ep{w}") for w in WORLDS] + [
    pytest.param((w, "cuda"), id=f"gpu-ep{w}", marks=pytest.mark.gpu) for w in (1, 2)]


@pytest.fixture(scope="module", params=GROUPS)
def group(request):
    world, device = request.param
    return world, _group_runs(world, device)


@functools.cache
def _group_runs(world, device):
    # cached in the process: pytest-xdist may set a module fixture up again on the same
    # worker (its items of one module need not arrive together), and a launch costs seconds
    # in Triton's interpreter; the tests only read the results
    return distmoe.launch(_scenarios, world, device=device, gpus=[0] if device == "cuda"
                          else None, timeout=120, args=(device,))


# --------------------------------------------------------------------------------------------
# References of the whole group
# --------------------------------------------------------------------------------------------


def _expected_outs(p, weighted):
    outs = [poison_(torch.empty(p.rows_per_rank, p.hidden, dtype=torch.bfloat16))
            for _ in range(p.world)]
    for s in range(p.world):
        rowwise_put_ref(p.x[s], p.ranks[s], p.rows[s], outs, p.probs[s] if weighted else None)
    return outs


def _dots(rows_NKD, is_read, vec_ND):
    dots = (rows_NKD.double() * vec_ND.double()[:, None, :]).sum(-1)
    return torch.where(is_read > 0, dots, 0.0).float()


def _check_movement(world, results, p, prefix=""):
    for weighted in (False, True):
        outs = _expected_outs(p, weighted)
        key = prefix + ("out_weighted" if weighted else "out")
        for r in range(world):
            assert_bits_equal(results[r][key], outs[r], f"rank {r}: {key}")
    for s in range(world):
        res = results[s]
        for weighted in (False, True):
            probs = p.probs[s] if weighted else None
            expected = rowwise_combine_get_ref(list(p.src), p.ranks[s], p.rows[s], probs)
            suffix = "_weighted" if weighted else ""
            assert_bits_equal(res[prefix + "y" + suffix], expected, f"rank {s}: combine_get")
            assert_bits_equal(res[prefix + "y_fused" + suffix], expected,
                              f"rank {s}: combine_get_fused")
        gathered, _, _ = rowwise_gather_ref(list(p.src), p.ranks[s].reshape(-1),
                                            p.rows[s].reshape(-1))
        assert_bits_equal(res[prefix + "gathered"], gathered, f"rank {s}: gather_get")


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_rows_move_bit_exact_with_invalid_routes(group):
    world, results = group
    p = make_problem(world, SEED)
    _check_movement(world, results, p)
    for r in range(world):  # rows no route names keep the poison: nothing else was written
        named = torch.zeros(p.rows_per_rank, dtype=torch.bool)
        for s in range(world):
            ok = (p.ranks[s] == r) & (p.rows[s] >= 0)
            named[p.rows[s][ok]] = True
        assert torch.all(results[r]["out"].view(torch.int16)[~named] == POISON)
        assert results[r]["stats"]["bad_put_routes"] == 0
        assert results[r]["stats"]["bad_get_routes"] == 0


def test_bad_routes_are_dropped_and_counted(group):
    world, results = group
    p = make_problem(world, BAD_SEED, bad=True)
    _check_movement(world, results, p, prefix="bad_")
    for s in range(world):
        stats = results[s]["bad_stats"]
        assert p.num_tokens[s] < 3 or p.bad[s] >= 2  # the problem has bad routes
        assert stats["bad_put_routes"] == 2 * p.bad[s]  # two dispatches
        # combine and fused combine, unweighted and weighted, and the gather
        assert stats["bad_get_routes"] == 5 * p.bad[s]


def test_gradients_of_each_node(group):
    world, results = group
    p = make_problem(world, SEED)
    g_out = [_upstream(100 + r, p.rows_per_rank, p.hidden) for r in range(world)]
    for s in range(world):
        res, ranks, rows = results[s], p.ranks[s], p.rows[s]
        # dispatch backward = combine GET of out's gradient: an fp32 sum in k order
        for key, probs in (("dispatch", None), ("dispatch_weighted", p.probs[s])):
            gx, gp = res[key]
            assert_bits_equal(gx, rowwise_combine_get_ref(g_out, ranks, rows, probs),
                              f"rank {s}: {key} input gradient")
        rows_g, is_read, _ = rowwise_gather_ref(g_out, ranks, rows)
        torch.testing.assert_close(res["dispatch_weighted"][1], _dots(rows_g, is_read, p.x[s]),
                                   rtol=1e-5, atol=1e-5)
    # combine backward = (weighted) PUT of y's gradient into expert_out's gradient: movement
    # (weighted: one bf16 rounding of fp32 g * p, the PUT's arithmetic)
    for key in ("combine", "combine_fused"):
        for suffix in ("", "_weighted"):
            grads = [torch.zeros(p.rows_per_rank, p.hidden, dtype=torch.bfloat16)
                     for _ in range(world)]
            for s in range(world):
                g_y = _upstream(200 + s, p.num_tokens[s], p.hidden)
                rowwise_put_ref(g_y, p.ranks[s], p.rows[s], grads, p.probs[s] if suffix else None)
            for r in range(world):
                assert_bits_equal(results[r][key + suffix][0], grads[r],
                                  f"rank {r}: {key}{suffix} expert_out gradient")
        for s in range(world):
            g_y = _upstream(200 + s, p.num_tokens[s], p.hidden)
            rows_s, is_read, _ = rowwise_gather_ref(list(p.src), p.ranks[s], p.rows[s])
            torch.testing.assert_close(results[s][key + "_weighted"][1],
                                       _dots(rows_s, is_read, g_y), rtol=1e-5, atol=1e-5)
    for s in range(world):  # each read route returns g_y[t]: their fp32 sum, rounded once
        g_y = _upstream(200 + s, p.num_tokens[s], p.hidden)
        read = rowwise_gather_ref(g_out, p.ranks[s], p.rows[s])[1] > 0
        count = read.sum(1, keepdim=True).float()
        expected = torch.where(count > 0, count * g_y.float(), 0.0).bfloat16()  # +0.0 if none
        assert_bits_equal(results[s]["round_trip"][0], expected, f"rank {s}: round trip")
    grads = [torch.zeros(p.rows_per_rank, p.hidden, dtype=torch.bfloat16) for _ in range(world)]
    for s in range(world):
        g = _upstream(400 + s, p.num_tokens[s] * p.top_k, p.hidden)
        rowwise_put_ref(g, p.ranks[s].reshape(-1), p.rows[s].reshape(-1), grads)
    for r in range(world):
        assert_bits_equal(results[r]["gather"][0], grads[r], f"rank {r}: gather gradient")


def _chain_ref(p, dtype):
    """Torch autograd of the plain-PyTorch chain in ``dtype`` (fp64: the oracle; bf16: sums
    in fp32, one rounding per result, as the kernels)."""
    xs = [_leaf(x.to(dtype)) for x in p.x]
    prob_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    pds = [_leaf(pr.to(prob_dtype)) for pr in p.probs]
    pcs = [_leaf((pr * 0.5).to(prob_dtype)) for pr in p.probs]
    outs = dispatch_put_ref(xs, list(p.ranks), list(p.rows),
                            [torch.zeros(p.rows_per_rank, p.hidden, dtype=dtype)] * p.world, pds)
    wide = torch.promote_types(dtype, torch.float32)
    hs = [(o.to(wide) * _scale(r, p.hidden).to(wide)).to(dtype) for r, o in enumerate(outs)]
    loss = 0
    ys = []
    for s in range(p.world):
        y = combine_get_diff_ref(hs, p.ranks[s], p.rows[s], pcs[s])
        ys.append(y)
        up = _upstream(500 + s, p.num_tokens[s], p.hidden).to(wide)
        loss = loss + (y.to(wide) * up).sum()
    loss.backward()
    return [(ys[s].detach(), xs[s].grad, pds[s].grad, pcs[s].grad) for s in range(p.world)]


def test_chain_gradients_against_fp64_oracle(group):
    world, results = group
    p = make_problem(world, SEED)
    oracle, torch_bf16 = _chain_ref(p, torch.float64), _chain_ref(p, torch.bfloat16)
    names = ("y", "input grad", "dispatch probs grad", "combine probs grad")
    for s in range(world):
        fused, unfused = results[s]["chain_fused"], results[s]["chain"]
        for i, name in enumerate(names):
            # the fused combine gives the unfused one's bits, forward and backward
            if unfused[i] is not None:
                assert torch.equal(fused[i], unfused[i]), f"rank {s}: fused {name} differs"
            ours, ref, base = unfused[i], oracle[s][i], torch_bf16[s][i]
            if ref is None or ref.numel() == 0:
                continue
            ref = torch.nan_to_num(ref.double(), nan=0.0)
            err = (ours.double() - ref).abs().max().item()
            err_torch = (torch.nan_to_num(base.double(), nan=0.0) - ref).abs().max().item()
            floor = ref.abs().max().item() / 128
            assert err <= 2 * err_torch + floor, (
                f"rank {s} {name}: error {err:.3g} > 2 x torch's {err_torch:.3g} + {floor:.3g}")


# --------------------------------------------------------------------------------------------
# check=True and argument errors (one launch of 2 ranks)
# --------------------------------------------------------------------------------------------


def _caught(fn):
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def _errors(rank, world):
    p = make_problem(world, BAD_SEED, bad=True)
    good = make_problem(world, SEED)
    ranks, rows, x = p.ranks[rank], p.rows[rank], p.x[rank]
    out = {}
    with rw.Buffers(None, p.rows_per_rank, p.hidden, backend="cpu", check=True) as bufs:
        poison_(bufs.out)
        snapshot = bufs.out.clone()
        out["dispatch_bad"] = _caught(lambda: rw.dispatch_put(x, ranks, rows, bufs.out))
        out["untouched"] = torch.equal(bufs.out.view(torch.int16), snapshot.view(torch.int16))
        out["combine_bad"] = _caught(lambda: rw.combine_get(bufs.expert_out, ranks, rows))
        out["gather_bad"] = _caught(lambda: rw.gather_get(bufs.expert_out, ranks.reshape(-1),
                                                          rows.reshape(-1)))
        xg = x.clone().requires_grad_(rank == 0)  # differentiable on rank 0 only
        ok_ranks = torch.where(ranks >= world, -1, ranks)
        ok_rows = torch.where(rows >= p.rows_per_rank, -1, rows)
        out["grad_mismatch"] = _caught(lambda: rw.dispatch_put(xg, ok_ranks, ok_rows, bufs.out))
        out["stats"] = bufs.stats()
    with rw.Buffers(None, good.rows_per_rank, good.hidden, backend="cpu", check=True) as bufs:
        poison_(bufs.out)
        rw.dispatch_put(good.x[rank], good.ranks[rank], good.rows[rank], bufs.out,
                        pre_barrier=True)
        out["checked_out"] = bufs.out.clone()
        out["args"] = _argument_errors(bufs, good, rank)
    out["buffers_args"] = [
        _caught(lambda: rw.Buffers(None, 0, 8)),
        _caught(lambda: rw.Buffers(None, 4, 8, dtype=torch.float16)),
        _caught(lambda: rw.Buffers(None, 4, 8, check=1)),
    ]
    return out


def _argument_errors(bufs, p, rank):
    ranks, rows, x, probs = p.ranks[rank], p.rows[rank], p.x[rank], p.probs[rank]
    n = x.shape[0]
    cases = {
        "out_slice": lambda: rw.dispatch_put(x, ranks, rows, bufs.out[:2]),
        "out_type": lambda: rw.dispatch_put(x, ranks, rows, "out"),
        "input_dtype": lambda: rw.dispatch_put(x.float(), ranks, rows, bufs.out),
        "input_width": lambda: rw.dispatch_put(x[:, :8].contiguous(), ranks, rows, bufs.out),
        "input_layout": lambda: rw.dispatch_put(x.t().contiguous().t(), ranks, rows, bufs.out),
        "ranks_dtype": lambda: rw.dispatch_put(x, ranks.float(), rows, bufs.out),
        "ranks_rows": lambda: rw.dispatch_put(x, ranks[: n - 1], rows, bufs.out),
        "rows_shape": lambda: rw.dispatch_put(x, ranks, rows[:, :1].contiguous(), bufs.out),
        "probs_shape": lambda: rw.dispatch_put(x, ranks, rows, bufs.out, probs[:, :1]),
        "probs_dtype": lambda: rw.dispatch_put(x, ranks, rows, bufs.out, probs.double()),
        "barrier_flag": lambda: rw.dispatch_put(x, ranks, rows, bufs.out, post_barrier=1),
        "src_slice": lambda: rw.combine_get(bufs.expert_out[1:], ranks, rows),
        "gather_2d": lambda: rw.gather_get(bufs.expert_out, ranks, rows),
        "combine_1d": lambda: rw.combine_get_fused(bufs.expert_out, ranks.reshape(-1),
                                                   rows.reshape(-1)),
    }
    poison_(bufs.out)
    snapshot = bufs.out.clone()
    caught = {name: _caught(fn) for name, fn in cases.items()}
    caught["untouched"] = torch.equal(bufs.out.view(torch.int16), snapshot.view(torch.int16))
    return caught


@pytest.fixture(scope="module")
def errors():
    return _errors_run()


@functools.cache
def _errors_run():
    # cached in the process: pytest-xdist may set a module fixture up again on the same
    # worker (its items of one module need not arrive together), and a launch costs seconds
    # in Triton's interpreter; the tests only read the results
    return distmoe.launch(_errors, 2, timeout=120)


def test_check_mode_refuses_bad_routes_on_every_rank(errors):
    p = make_problem(2, BAD_SEED, bad=True)
    for rank, res in enumerate(errors):
        for key, op in (("dispatch_bad", "dispatch_put"), ("combine_bad", "combine_get"),
                        ("gather_bad", "gather_get")):
            kind, msg = res[key]
            assert kind == "ValueError"
            if p.bad[rank]:
                assert f"{op}: {p.bad[rank]} bad routes" in msg and f"on rank {rank}" in msg
                assert "world size 2" in msg and f"rows {p.rows_per_rank}" in msg
            else:
                assert "failed the route check" in msg
        assert res["untouched"]  # refused before any PUT
        kind, msg = res["grad_mismatch"]
        assert kind == "ValueError" and "differentiable" in msg and "ranks [0] only" in msg
        assert res["stats"]["bad_put_routes"] == res["stats"]["bad_get_routes"] == 0


def test_argument_errors_name_the_argument(errors):
    p = make_problem(2, SEED)
    expected = {
        "out_slice": ("ValueError", r"out must be the \.out or \.expert_out tensor"),
        "out_type": ("TypeError", r"out must be a torch\.Tensor .*got str"),
        "input_dtype": ("TypeError", r"input must have dtype bfloat16, got torch\.float32"),
        "input_width": ("ValueError", r"input must have shape \[N, hidden\] with hidden = 24"),
        "input_layout": ("ValueError", r"input must be contiguous, got strides"),
        "ranks_dtype": ("TypeError", r"dst_ranks must have dtype int8 or int16 or int32"),
        "ranks_rows": ("ValueError", r"dst_ranks must have shape \[N, K\] with N = "),
        "rows_shape": ("ValueError", r"dst_rows must have shape \[\d+, 2\] \(the shape of "
                                     r"dst_ranks\)"),
        "probs_shape": ("ValueError", r"probs must have shape \[\d+, 2\]"),
        "probs_dtype": ("TypeError", r"probs must have dtype float32 or bfloat16 or float16"),
        "barrier_flag": ("TypeError", r"post_barrier must be a bool, got 1"),
        "src_slice": ("ValueError", r"expert_out must be the \.out or \.expert_out tensor"),
        "gather_2d": ("ValueError", r"src_ranks must be 1-D \[N\]"),
        "combine_1d": ("ValueError", r"src_ranks must be 2-D \[N, K\]"),
    }
    for rank, res in enumerate(errors):
        # check=True with good routes: the same bits as an unchecked call
        assert_bits_equal(res["checked_out"], _expected_outs(p, False)[rank], "checked call")
        args = res["args"]
        assert args.pop("untouched")  # no argument error touched a buffer
        for name, (kind, pattern) in expected.items():
            got = args[name]
            assert got is not None and got[0] == kind and re.search(pattern, got[1]), (name, got)
        kinds = [(k, m) for k, m in res["buffers_args"]]
        assert kinds[0][0] == "ValueError" and "rows (0) must be an int >= 1" in kinds[0][1]
        assert kinds[1][0] == "ValueError" and "must be torch.bfloat16" in kinds[1][1]
        assert kinds[2][0] == "TypeError" and "check must be a bool, got 1" in kinds[2][1]
