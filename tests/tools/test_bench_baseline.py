"""Numerics of the torch baseline against a plain per-token float64 loop (EP=1 and EP=2 gloo).

Tolerances:
- float32 inputs: the baseline differs from float64 only by fp32 rounding of a few short dot
  products (D, F <= 48), so 1e-5 of the output's largest magnitude is ample.
- bfloat16 inputs: the baseline rounds h1, h2 and h3 to bf16 (unit roundoff 2^-8 each) and the
  fp32 combine to bf16 at the end; a few roundings of relative size 2^-8 bound the error by
  about 4 * 2^-8 = 1.6e-2 of the largest magnitude, so 3e-2 leaves margin without hiding a
  wrong route (which changes outputs by O(1) of the scale).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from distmoe.tools.bench import baseline
from distmoe.tools.bench.timing import TimingConfig, benchmark


def loop_reference(x, expert_ids, scores, w13, w2):
    """y[t] = sum_k score[t,k] * W2_e (silu(W13_e,gate x_t) * (W13_e,up x_t)), float64, autograd."""
    x, scores, w13, w2 = (t.double() for t in (x, scores, w13, w2))
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(expert_ids.shape[1]):
            e = int(expert_ids[t, k])
            if e < 0:
                continue
            h2 = F.silu(w13[e, 0] @ x[t]) * (w13[e, 1] @ x[t])
            acc = acc + scores[t, k] * (w2[e] @ h2)
        rows.append(acc)
    return torch.stack(rows)


def make_case(T, D, Fw, E, K, dtype, *, inactive=(), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    scores = torch.softmax(torch.randn(T, K, generator=gen), dim=1)
    for t, k in inactive:
        ids[t, k] = -1
        scores[t, k] = 0.0
    w13 = (torch.randn(E, 2, Fw, D, generator=gen) * D**-0.5).to(dtype)
    w2 = (torch.randn(E, D, Fw, generator=gen) * Fw**-0.5).to(dtype)
    grad_y = torch.randn(T, D, generator=gen).to(dtype)
    return x, ids, scores, w13, w2, grad_y


def _max_rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


PATHS = ["loop", "grouped_mm"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "T, D, Fw, E, K, inactive",
    [
        (13, 16, 8, 5, 3, ()),  # odd T, prime E
        (9, 16, 24, 4, 1, ()),  # K = 1
        (6, 8, 8, 3, 3, ()),  # K = E: every token uses every expert
        (11, 16, 8, 6, 2, ((0, 0), (3, 1), (4, 0), (4, 1))),  # inactive routes, token 4 all off
    ],
)
def test_fp32_forward_and_grads_match_loop(path, T, D, Fw, E, K, inactive):
    if path == "grouped_mm" and baseline.grouped_mm_path("cpu", torch.float32)[0] != "grouped_mm":
        pytest.skip("torch._grouped_mm unusable on this CPU build")
    x, ids, scores, w13, w2, grad_y = make_case(T, D, Fw, E, K, torch.float32, inactive=inactive)
    leaves = [t.clone().requires_grad_(True) for t in (x, scores, w13, w2)]
    y = baseline.torch_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], path=path)
    grads = torch.autograd.grad(y, leaves, grad_y)

    ref_leaves = [t.double().requires_grad_(True) for t in (x, scores, w13, w2)]
    y_ref = loop_reference(ref_leaves[0], ids, *ref_leaves[1:])
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, grad_y.double())

    assert y.dtype == torch.float32 and y.shape == (T, D)
    assert _max_rel(y, y_ref) < 1e-5
    for name, g, r in zip(("x", "scores", "w13", "w2"), grads, ref_grads, strict=True):
        assert _max_rel(g, r) < 1e-5, name
    for t, k in inactive:
        assert grads[1][t, k] == 0  # a disabled route has no score gradient
    if (4, 0) in inactive and (4, 1) in inactive:
        assert torch.equal(y[4], torch.zeros(D))  # a token with all routes disabled is exactly 0


@pytest.mark.parametrize("path", PATHS)
def test_bf16_forward_and_grads(path):
    # all tokens to expert 2 for half the routes: one heavily loaded expert
    if path == "grouped_mm" and baseline.grouped_mm_path("cpu", torch.bfloat16)[0] != "grouped_mm":
        pytest.skip("torch._grouped_mm unusable on this CPU build")
    T, D, Fw, E, K = 24, 32, 16, 6, 2
    x, ids, scores, w13, w2, grad_y = make_case(T, D, Fw, E, K, torch.bfloat16, inactive=((5, 1),))
    ids[:, 0] = 2
    ids[:, 1] = torch.where(ids[:, 1] == 2, 3, ids[:, 1])
    ids[5, 1] = -1
    leaves = [t.clone().requires_grad_(True) for t in (x, scores, w13, w2)]
    y = baseline.torch_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], path=path)
    grads = torch.autograd.grad(y, leaves, grad_y)
    ref_leaves = [t.double().requires_grad_(True) for t in (x, scores, w13, w2)]
    y_ref = loop_reference(ref_leaves[0], ids, *ref_leaves[1:])
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, grad_y.double())
    assert y.dtype == torch.bfloat16
    assert _max_rel(y, y_ref) < 3e-2
    for name, g, r in zip(("x", "scores", "w13", "w2"), grads, ref_grads, strict=True):
        assert _max_rel(g, r) < 3e-2, name


def test_probe_is_independent_of_grad_mode():
    # the harness first asks for the path under no_grad (inference); the probe needs autograd
    baseline._probe_grouped_mm.cache_clear()
    with torch.no_grad():
        under_no_grad = baseline.grouped_mm_path("cpu", torch.float32)
    baseline._probe_grouped_mm.cache_clear()
    assert baseline.grouped_mm_path("cpu", torch.float32) == under_no_grad


def test_int16_ids_and_path_report():
    x, ids, scores, w13, w2, _ = make_case(7, 16, 8, 4, 2, torch.float32)
    y64 = baseline.torch_moe(x, ids, scores, w13, w2, path="loop")
    y16 = baseline.torch_moe(x, ids.to(torch.int16), scores, w13, w2, path="loop")
    assert torch.equal(y64, y16)
    path, reason = baseline.grouped_mm_path("cpu", torch.bfloat16)
    assert path in ("grouped_mm", "loop") and (path == "loop") == bool(reason)


# ----------------------------------------------------------------------------- EP = 2 over gloo

EP_T, EP_D, EP_F, EP_E, EP_K = 10, 16, 8, 6, 2
EP_INACTIVE = {0: ((2, 1), (7, 0), (7, 1)), 1: ((0, 0),)}


def _ep_case(rank: int, world: int):
    """Rank ``rank``'s tokens, ids, scores and output gradient (float32); same on every process."""
    x, ids, scores, _, _, grad_y = make_case(
        EP_T, EP_D, EP_F, EP_E, EP_K, torch.float32, inactive=EP_INACTIVE[rank], seed=100 + rank
    )
    if rank == 1:
        # first slot of every token to rank 0's experts: unequal split sizes
        ids[:, 0] = torch.arange(EP_T) % (EP_E // world)
        ids[0, 0] = -1
        scores[0, 0] = 0.0
    return x, ids, scores, grad_y


def _ep_worker(rank: int, world: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        e_local = EP_E // world
        shard = slice(rank * e_local, (rank + 1) * e_local)
        _, _, _, w13, w2, _ = make_case(EP_T, EP_D, EP_F, EP_E, EP_K, torch.float32, seed=7)
        cases = [_ep_case(r, world) for r in range(world)]
        x, ids, scores, grad_y = cases[rank]

        # float64 reference of the whole EP group's loss sum_r <y_r, grad_y_r>
        ref_w13 = w13.double().requires_grad_(True)
        ref_w2 = w2.double().requires_grad_(True)
        ref_x = x.double().requires_grad_(True)
        ref_s = scores.double().requires_grad_(True)
        loss = 0
        for r, (xr, idr, sr, gr) in enumerate(cases):
            if r == rank:
                y_ref = loop_reference(ref_x, idr, ref_s, ref_w13, ref_w2)
                loss = loss + (y_ref * gr.double()).sum()
            else:
                loss = loss + (loop_reference(xr, idr, sr, ref_w13, ref_w2) * gr.double()).sum()
        ref_gx, ref_gs, ref_gw13, ref_gw2 = torch.autograd.grad(
            loss, (ref_x, ref_s, ref_w13, ref_w2)
        )

        for path in PATHS:
            if path == "grouped_mm" and baseline.grouped_mm_path("cpu", torch.float32)[0] != path:
                continue
            leaves = [
                x.clone().requires_grad_(True),
                scores.clone().requires_grad_(True),
                w13[shard].clone().requires_grad_(True),
                w2[shard].clone().requires_grad_(True),
            ]
            y = baseline.torch_moe(
                leaves[0], ids, leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, path=path
            )
            grads = torch.autograd.grad(y, leaves, grad_y)
            assert _max_rel(y, y_ref) < 1e-5, (rank, path, "y")
            want = (ref_gx, ref_gs, ref_gw13[shard], ref_gw2[shard])
            for name, g, r in zip(("x", "scores", "w13", "w2"), grads, want, strict=True):
                assert _max_rel(g, r) < 1e-5, (rank, path, name)

        # bf16 rows through gloo's all_to_all_single
        y_bf = baseline.torch_moe(
            x.bfloat16(),
            ids,
            scores,
            w13[shard].bfloat16(),
            w2[shard].bfloat16(),
            group=dist.group.WORLD,
        )
        assert y_bf.dtype == torch.bfloat16 and _max_rel(y_bf, y_ref) < 3e-2, (rank, "bf16")

        # Timing over the group: every rank reports the same (rank-maximum) windows.
        res = benchmark(
            lambda: None,
            config=TimingConfig(num_warmup=0, num_windows=3, iters_per_window=2, capture_iters=2),
            group=dist.group.WORLD,
            device="cpu",
        )
        seen = [None] * world
        dist.all_gather_object(seen, res.stats)
        assert all(s == seen[0] for s in seen), seen
    finally:
        dist.destroy_process_group()


def test_ep2_gloo_matches_loop():
    # gloo implements all_to_all_single (bf16 included), so the whole EP>1 path runs on CPU
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ep_worker, args=(2, os.path.join(tmp, "store")), nprocs=2, join=True)
