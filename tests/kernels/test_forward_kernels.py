"""Forward expert kernels: W13 gather + SwiGLU, W2 scatter, owner combine.

On CPU the kernels run through Triton's interpreter at small shapes (block_m 16, D/F 32-64);
the ``gpu`` tests repeat them at Hopper tile sizes. Every output is poisoned with NaN before a
run: a row the kernel must write cannot pass the tolerance check while still poisoned, and a
row it must not touch is compared bit-exactly with the poison.

Tolerances (``assert_bf16_close``): every kernel computes in fp32 and rounds once to bf16,
compared against an fp64 result from the same bf16 inputs.
"""

from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

ON_INTERPRETER = use_interpreter_if_no_gpu()

import math  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.combine import CombineConfig, combine, combine_ref  # noqa: E402
from distmoe.kernels.w2_scatter import W2Config, w2_scatter, w2_scatter_ref  # noqa: E402
from distmoe.kernels.w13_gather_swiglu import (  # noqa: E402
    W13Config,
    gather_w13_swiglu,
    gather_w13_swiglu_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Small tiles for the interpreter: block_m 16 is the padding multiple of these tests.
BM = 16
W13_SMALL = W13Config(block_m=BM, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)
W2_SMALL = W2Config(block_m=BM, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, *, what: str) -> None:
    """bf16 kernel output against an fp64 expectation.

    Relative 2^-7: bf16 keeps 8 significant bits, so rounding the fp32 result moves it by at
    most 2^-8 relative; the second half-ulp of slack covers the fp32 result differing from
    fp64 in its last bits right at a rounding boundary. Absolute 1e-3 of the largest
    magnitude: for elements that cancel to near zero, fp32 accumulation-order error (about
    n * 2^-24 * sum|terms|, n <= 1024 here) dominates; 1e-3 is far above it and far below
    any indexing mistake (wrong row, expert or column: O(1) relative error).
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    got = actual.double().cpu()
    want = expected.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN (poison left or produced)"
    scale = want.abs().max().item() if want.numel() else 0.0
    bound = 2**-7 * want.abs() + 1e-3 * scale
    err = (got - want).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance, "
        f"max err {err.max().item():.3g} (scale {scale:.3g})"
    )


def poisoned(*shape: int) -> torch.Tensor:
    """bf16 NaN-filled output buffer."""
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)


def assert_untouched(tensor: torch.Tensor, *, what: str) -> None:
    """Every element still holds the NaN poison, bit for bit."""
    poison = torch.full_like(tensor, float("nan")).view(torch.int16)
    assert torch.equal(tensor.view(torch.int16), poison), f"{what}: written, must be untouched"


def addr(tensor: torch.Tensor, row: int, row_elems: int) -> int:
    """Absolute byte address of ``row`` of a contiguous bf16 tensor seen as rows."""
    return tensor.data_ptr() + row * row_elems * tensor.element_size()


def build_layout(counts, *, r_cap, block_m=BM, min_rows=None):
    """Padded expert-major layout: int32 padded_offsets and, per expert, its live rows.

    Each expert's segment is ``ceil(n / block_m) * block_m`` rows (at least ``min_rows[e]``:
    a routing layer may pad an empty expert to a whole null tile); the ``n`` live rows sit at
    random positions of the segment, so null rows are interspersed, not only trailing.
    """
    offsets = [0]
    live = []
    for e, n in enumerate(counts):
        seg = math.ceil(n / block_m) * block_m
        if min_rows is not None:
            seg = max(seg, min_rows[e])
        start = offsets[-1]
        live.append(sorted((torch.randperm(seg)[:n] + start).tolist()))
        offsets.append(start + seg)
    assert offsets[-1] <= r_cap, "test layout exceeds R_cap"
    padded_offsets = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    return padded_offsets, offsets, live


def peer_sources(hidden: int) -> list[torch.Tensor]:
    """Several source tensors standing in for peers' dispatch buffers (one a row slice of a
    larger buffer, one 3-D [T, K, D])."""
    big = torch.randn(20, hidden, device=DEVICE).to(torch.bfloat16)
    return [
        torch.randn(11, hidden, device=DEVICE).to(torch.bfloat16),
        torch.randn(4, 3, hidden, device=DEVICE).to(torch.bfloat16),
        big[5:12],
    ]


def gather_table(live, r_cap, sources, hidden):
    """gather_ptrs for the live rows (random rows of random sources) and the fp64 rows."""
    ptrs = torch.zeros(r_cap, dtype=torch.int64)
    x = torch.zeros(r_cap, hidden, dtype=torch.float64)
    for rows in live:
        for r in rows:
            i = int(torch.randint(len(sources), ()))
            src = sources[i].reshape(-1, hidden)
            j = int(torch.randint(src.shape[0], ()))
            ptrs[r] = addr(sources[i], j, hidden)
            x[r] = src[j].double().cpu()
    return ptrs.to(DEVICE), x


def w13_expected(x, w13, offsets):
    """fp64 g, u, h2 for the used rows ``[0, offsets[-1])``."""
    total = offsets[-1]
    ffn = w13.shape[2]
    g = torch.zeros(total, ffn, dtype=torch.float64)
    u = torch.zeros(total, ffn, dtype=torch.float64)
    for e, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        g[start:end] = x[start:end] @ w13[e, 0].double().cpu().T
        u[start:end] = x[start:end] @ w13[e, 1].double().cpu().T
    return g, u, torch.nn.functional.silu(g) * u


def random_weights(num_experts, hidden, ffn):
    # Scaled so that g, u and h3 stay O(1).
    w13 = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(ffn)
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# W13 gather + SwiGLU
# --------------------------------------------------------------------------------------------


def run_w13_case(
    counts, *, hidden, ffn, r_cap, config, min_rows=None, training=True, use_ref=False
):
    padded_offsets, offsets, live = build_layout(
        counts, r_cap=r_cap, block_m=config.block_m, min_rows=min_rows
    )
    sources = peer_sources(hidden)
    gather_ptrs, x = gather_table(live, r_cap, sources, hidden)
    w13, _ = random_weights(len(counts), hidden, ffn)
    h2 = poisoned(r_cap, ffn)
    h1 = poisoned(r_cap, 2 * ffn) if training else None
    x_out = poisoned(r_cap, hidden) if training else None
    if use_ref:
        gather_w13_swiglu_ref(
            gather_ptrs,
            padded_offsets,
            w13,
            h2,
            h1_out=h1,
            x_out=x_out,
            sources=sources,
            block_m=config.block_m,
        )
    else:
        gather_w13_swiglu(
            gather_ptrs, padded_offsets, w13, h2, h1_out=h1, x_out=x_out, config=config
        )

    total = offsets[-1]
    g, u, h2_exp = w13_expected(x, w13, offsets)
    assert_bf16_close(h2[:total], h2_exp, what="h2")
    assert_untouched(h2[total:], what="h2 rows beyond padded_offsets[-1]")
    null = torch.ones(r_cap, dtype=torch.bool)
    null[[r for rows in live for r in rows]] = False
    null[total:] = False
    # Null rows read zeros: h2 (and h1, x_out) rows are exact zeros.
    assert torch.equal(
        h2[null.to(DEVICE)].float(), torch.zeros(int(null.sum()), ffn, device=DEVICE)
    )
    if training:
        assert_bf16_close(h1[:total], torch.cat([g, u], dim=1), what="h1")
        assert_untouched(h1[total:], what="h1 rows beyond padded_offsets[-1]")
        # The saved rows are a bit-exact copy of the gathered bf16 rows (zeros for null rows).
        assert torch.equal(x_out[:total].double().cpu(), x[:total]), (
            "x_out is not the gathered rows"
        )
        assert_untouched(x_out[total:], what="x_out rows beyond padded_offsets[-1]")
    return h2


GRIDS = pytest.mark.parametrize(
    "persistent, host_descriptors",
    [(False, True), (True, True), (False, False), (True, False)],
    ids=["tile_grid", "persistent", "tile_grid-device_desc", "persistent-device_desc"],
)


@GRIDS
def test_w13_mixed_experts(persistent, host_descriptors):
    # Experts with 5, 0, 16 and 21 rows (one empty, one exactly one tile), peers' rows from
    # three sources, F=48 not a multiple of block_n=32, two idle tiles beyond the used rows.
    config = replace(W13_SMALL, persistent=persistent, host_descriptors=host_descriptors)
    run_w13_case([5, 0, 16, 21], hidden=64, ffn=48, r_cap=96, config=config)


def test_w13_hidden_not_multiple_of_block_k():
    # D=40 against block_k=32: the last K step is masked (rows) / zero-filled (TMA weights).
    run_w13_case([7, 18], hidden=40, ffn=32, r_cap=64, config=W13_SMALL)


def test_w13_one_expert_all_rows():
    # Every row goes to the last of three experts; R_cap exactly full (no idle tile).
    run_w13_case([0, 0, 37], hidden=32, ffn=32, r_cap=48, config=W13_SMALL)


def test_w13_all_null_tile_and_inference():
    # Expert 1 is empty but padded to a whole null tile (zeros out); inference: no h1/x_out.
    run_w13_case(
        [3, 0, 9],
        hidden=32,
        ffn=64,
        r_cap=64,
        config=W13_SMALL,
        min_rows=[0, 16, 0],
        training=False,
    )


def test_w13_no_rows():
    # No routed rows at all: every tile is idle and nothing is written.
    r_cap, hidden, ffn = 32, 32, 32
    padded_offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    gather_ptrs = torch.zeros(r_cap, dtype=torch.int64, device=DEVICE)
    w13, _ = random_weights(2, hidden, ffn)
    h2, h1, x_out = poisoned(r_cap, ffn), poisoned(r_cap, 2 * ffn), poisoned(r_cap, hidden)
    gather_w13_swiglu(
        gather_ptrs, padded_offsets, w13, h2, h1_out=h1, x_out=x_out, config=W13_SMALL
    )
    for name, out in (("h2", h2), ("h1", h1), ("x_out", x_out)):
        assert_untouched(out, what=name)


def test_w13_default_config_from_block_m():
    # config=None: the heuristic config at the caller's padding multiple.
    padded_offsets, offsets, live = build_layout([4, 20], r_cap=48)
    sources = peer_sources(32)
    gather_ptrs, x = gather_table(live, 48, sources, 32)
    w13, _ = random_weights(2, 32, 32)
    h2 = poisoned(48, 32)
    gather_w13_swiglu(gather_ptrs, padded_offsets, w13, h2, block_m=BM)
    assert_bf16_close(h2[: offsets[-1]], w13_expected(x, w13, offsets)[2], what="h2")
    assert_untouched(h2[offsets[-1] :], what="idle rows")


def test_w13_reference():
    # The plain-PyTorch reference obeys the same contract (within the same tolerance).
    run_w13_case([5, 0, 21], hidden=32, ffn=48, r_cap=64, config=W13_SMALL, use_ref=True)


def _w13_inputs(r_cap=32, hidden=32, ffn=32, num_experts=2):
    w13, _ = random_weights(num_experts, hidden, ffn)
    return dict(
        gather_ptrs=torch.zeros(r_cap, dtype=torch.int64, device=DEVICE),
        padded_offsets=torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE),
        w13=w13,
        h2_out=poisoned(r_cap, ffn),
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(gather_ptrs=a["gather_ptrs"].int()), TypeError, "gather_ptrs must have dtype int64"),
        (lambda a: a.update(w13=a["w13"].float()), TypeError, "w13 must have dtype bfloat16"),
        (lambda a: a.update(w13=a["w13"][:, :1].contiguous()), ValueError, r"w13 must have shape \[E_local >= 1, 2, F, D\]"),
        (lambda a: a.update(w13=a["w13"][..., :12].contiguous()), ValueError, r"D \(hidden\) \(12\) must be a positive multiple of 8"),
        (lambda a: a.update(w13=a["w13"].transpose(2, 3)), ValueError, "w13 must be contiguous"),
        (lambda a: a.update(padded_offsets=a["padded_offsets"][:2]), ValueError, r"padded_offsets must have shape \[3\]"),
        (lambda a: a.update(padded_offsets=a["padded_offsets"].long()), TypeError, "padded_offsets must have dtype int32"),
        (lambda a: a.update(h2_out=a["h2_out"][:, :16].contiguous()), ValueError, r"h2_out must have shape \[32, 32\]"),
        (lambda a: a.update(h1_out=poisoned(32, 32)), ValueError, r"h1_out must have shape \[32, 64\]"),
        (lambda a: a.update(x_out=poisoned(32, 32).float()), TypeError, "x_out must have dtype bfloat16"),
        (lambda a: a.update(gather_ptrs=a["gather_ptrs"][:24], h2_out=a["h2_out"][:24]), ValueError, r"R_cap \(24, rows of gather_ptrs\) must be a multiple of block_m \(16\)"),
        (lambda a: a.update(block_m=32), ValueError, r"block_m \(32\) must equal config.block_m \(16\)"),
        (lambda a: a.update(config=W2_SMALL), TypeError, "config must be a W13Config"),
    ],
)  # fmt: skip
def test_w13_rejects_bad_inputs(change, error, match):
    args = _w13_inputs()
    args["config"] = W13_SMALL
    change(args)
    with pytest.raises(error, match=match):
        gather_w13_swiglu(**args)


# --------------------------------------------------------------------------------------------
# W2 scatter
# --------------------------------------------------------------------------------------------


def run_w2_case(counts, *, hidden, ffn, r_cap, config, min_rows=None, use_ref=False):
    padded_offsets, offsets, live = build_layout(
        counts, r_cap=r_cap, block_m=config.block_m, min_rows=min_rows
    )
    total = offsets[-1]
    num_live = sum(len(rows) for rows in live)
    # Peers' combine buffers: every live row gets its own destination row in one of them.
    targets = [poisoned(num_live, hidden), poisoned(9, 2, hidden), poisoned(num_live + 3, hidden)]
    slots = [(i, j) for i, t in enumerate(targets) for j in range(t.numel() // hidden)]
    order = torch.randperm(len(slots)).tolist()
    scatter_ptrs = torch.zeros(r_cap, dtype=torch.int64)
    destination = {}
    for n, r in enumerate(r for rows in live for r in rows):
        i, j = slots[order[n]]
        scatter_ptrs[r] = addr(targets[i], j, hidden)
        destination[r] = (i, j)
    # Rows beyond padded_offsets[-1] carry addresses too: idle tiles must not store them.
    canary = poisoned(r_cap - total, hidden)
    for n, r in enumerate(range(total, r_cap)):
        scatter_ptrs[r] = addr(canary, n, hidden)
    scatter_ptrs = scatter_ptrs.to(DEVICE)

    h2 = torch.randn(r_cap, ffn, device=DEVICE).to(torch.bfloat16)
    _, w2 = random_weights(len(counts), hidden, ffn)
    if use_ref:
        w2_scatter_ref(
            h2, padded_offsets, w2, scatter_ptrs, targets=targets, block_m=config.block_m
        )
    else:
        w2_scatter(h2, padded_offsets, w2, scatter_ptrs, config=config)

    written = [torch.zeros(t.numel() // hidden, dtype=torch.bool) for t in targets]
    for e, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        h3 = h2[start:end].double().cpu() @ w2[e].double().cpu().T
        for r in live[e]:
            i, j = destination[r]
            got = targets[i].reshape(-1, hidden)[j]
            assert_bf16_close(got, h3[r - start], what=f"h3 row {r} (expert {e})")
            written[i][j] = True
    for i, t in enumerate(targets):
        rows = t.reshape(-1, hidden)
        # Rows no live row points at (skipped, null or spare) keep the poison bit-exactly.
        assert_untouched(rows[(~written[i]).to(DEVICE)], what=f"target {i} rows not addressed")
    assert_untouched(canary, what="rows addressed by idle tiles")


@GRIDS
def test_w2_scatter_mixed_experts(persistent, host_descriptors):
    # Experts with 5, 0, 16 and 21 rows, an empty expert padded to a whole null tile
    # (skipped), D=48 not a multiple of block_n=32, F=40 not a multiple of block_k=32,
    # destinations in three peer buffers, idle tiles with live-looking addresses.
    config = replace(W2_SMALL, persistent=persistent, host_descriptors=host_descriptors)
    run_w2_case([5, 0, 16, 21], hidden=48, ffn=40, r_cap=112, config=config, min_rows=[0, 16, 0, 0])


def test_w2_scatter_one_expert_all_rows():
    # All rows go to the middle of three experts; R_cap exactly full.
    run_w2_case([0, 40, 0], hidden=32, ffn=64, r_cap=48, config=W2_SMALL)


def test_w2_scatter_default_config_from_block_m():
    padded_offsets, offsets, live = build_layout([9, 3], r_cap=48)
    hidden, ffn = 32, 32
    target = poisoned(12, hidden)
    scatter_ptrs = torch.zeros(48, dtype=torch.int64)
    rows = [r for rs in live for r in rs]
    for n, r in enumerate(rows):
        scatter_ptrs[r] = addr(target, n, hidden)
    h2 = torch.randn(48, ffn, device=DEVICE).to(torch.bfloat16)
    _, w2 = random_weights(2, hidden, ffn)
    w2_scatter(h2, padded_offsets, w2, scatter_ptrs.to(DEVICE), block_m=BM)
    for n, r in enumerate(rows):
        e = 0 if r < offsets[1] else 1
        assert_bf16_close(target[n], h2[r].double().cpu() @ w2[e].double().cpu().T, what="h3")


def test_w2_scatter_reference():
    # The plain-PyTorch reference obeys the same contract (within the same tolerance).
    run_w2_case([5, 0, 21], hidden=32, ffn=48, r_cap=64, config=W2_SMALL, use_ref=True)


def _w2_inputs(r_cap=32, hidden=32, ffn=32, num_experts=2):
    _, w2 = random_weights(num_experts, hidden, ffn)
    return dict(
        h2=torch.zeros(r_cap, ffn, dtype=torch.bfloat16, device=DEVICE),
        padded_offsets=torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE),
        w2=w2,
        scatter_ptrs=torch.zeros(r_cap, dtype=torch.int64, device=DEVICE),
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(h2=a["h2"].half()), TypeError, "h2 must have dtype bfloat16"),
        (lambda a: a.update(h2=a["h2"][:, :16].contiguous()), ValueError, r"h2 must have shape \[R_cap, F=32\]"),
        (lambda a: a.update(h2=a["h2"].t()), ValueError, "h2 must be contiguous"),
        (lambda a: a.update(w2=a["w2"][:, :20].contiguous()), ValueError, r"D \(hidden\) \(20\) must be a positive multiple of 8"),
        (lambda a: a.update(scatter_ptrs=a["scatter_ptrs"][:16]), ValueError, r"scatter_ptrs must have shape \[32\]"),
        (lambda a: a.update(scatter_ptrs=a["scatter_ptrs"].float()), TypeError, "scatter_ptrs must have dtype int64"),
        (lambda a: a.update(padded_offsets=a["padded_offsets"][None]), ValueError, r"padded_offsets must have shape \[3\]"),
        (lambda a: a.update(config=W13_SMALL), TypeError, "config must be a W2Config"),
    ],
)  # fmt: skip
def test_w2_scatter_rejects_bad_inputs(change, error, match):
    args = _w2_inputs()
    args["config"] = W2_SMALL
    change(args)
    with pytest.raises(error, match=match):
        w2_scatter(**args)


# --------------------------------------------------------------------------------------------
# Combine
# --------------------------------------------------------------------------------------------


def run_combine_case(num_tokens, max_tokens, top_k, hidden, *, id_dtype, score_dtype, config, use_ref=False, three_d=False):  # fmt: skip
    expert_ids = torch.randint(0, 5, (num_tokens, top_k))
    expert_ids[torch.rand(num_tokens, top_k) < 0.3] = -1
    if num_tokens > 2:
        expert_ids[2] = -1  # one token with every route inactive
    scores = torch.rand(num_tokens, top_k)
    is_active = expert_ids >= 0
    rows = torch.randn(max_tokens * top_k, hidden).to(torch.bfloat16)
    # Inactive routes and rows beyond T*K hold NaN: they must never be read.
    rows[: num_tokens * top_k][~is_active.reshape(-1)] = float("nan")
    rows[num_tokens * top_k :] = float("nan")
    scores[~is_active] = float("nan")
    scores = scores.to(score_dtype)

    expected = (
        torch.where(is_active, scores.double(), 0.0)[..., None]
        * torch.where(is_active[..., None], rows[: num_tokens * top_k].double().reshape(num_tokens, top_k, hidden), 0.0)
    ).sum(dim=1)  # fmt: skip

    rows_arg = rows.reshape(max_tokens, top_k, hidden) if three_d else rows
    y = poisoned(num_tokens, hidden)
    args = (rows_arg.to(DEVICE), expert_ids.to(id_dtype).to(DEVICE), scores.to(DEVICE), y)
    if use_ref:
        combine_ref(*args)
    else:
        combine(*args, config=config)
    assert_bf16_close(y, expected, what="y")
    none_active = ~is_active.any(dim=1)
    # Tokens with no active route are exact zeros.
    assert torch.equal(
        y[none_active.to(DEVICE)].float().cpu(), torch.zeros(int(none_active.sum()), hidden)
    )


COMBINE_SMALL = CombineConfig(block_t=4, block_d=32, num_warps=4)


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.int16, torch.int8])
@pytest.mark.parametrize("score_dtype", [torch.float32, torch.bfloat16])
def test_combine(id_dtype, score_dtype):
    # T=13 (not a multiple of block_t=4) of T_max=16, K=3, D=48 (not a multiple of block_d=32).
    run_combine_case(
        13, 16, 3, 48, id_dtype=id_dtype, score_dtype=score_dtype, config=COMBINE_SMALL
    )


def test_combine_top1_three_d_rows_default_config():
    # K=1, combine_rows given as [T_max, K, D], heuristic config.
    run_combine_case(7, 8, 1, 40, id_dtype=torch.int64, score_dtype=torch.float32, config=None, three_d=True)  # fmt: skip


def test_combine_no_tokens():
    # T=0: nothing to do, nothing touched.
    y = poisoned(0, 32)
    rows = torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    combine(rows, ids, torch.zeros(0, 2, device=DEVICE), y)
    assert y.shape == (0, 32)


def test_combine_reference():
    run_combine_case(13, 16, 3, 48, id_dtype=torch.int16, score_dtype=torch.float32, config=None, use_ref=True)  # fmt: skip


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(expert_ids=a["expert_ids"].float()), TypeError, "expert_ids must have dtype"),
        (lambda a: a.update(scores=a["scores"][:, :1]), ValueError, r"scores must have shape \[5, 2\]"),
        (lambda a: a.update(scores=a["scores"].double()), TypeError, "scores must have dtype"),
        (lambda a: a.update(y_out=a["y_out"][:4]), ValueError, r"y_out must have T=5 rows"),
        (lambda a: a.update(combine_rows=a["combine_rows"][:8]), ValueError, r"T_max >= T=5"),
        (lambda a: a.update(combine_rows=a["combine_rows"][:, :8].contiguous()), ValueError, "combine_rows must have shape"),
        (lambda a: a.update(combine_rows=a["combine_rows"].t().contiguous().t()), ValueError, "combine_rows must be contiguous"),
        (lambda a: a.update(expert_ids=a["expert_ids"].t()), ValueError, "expert_ids must be contiguous"),
    ],
)  # fmt: skip
def test_combine_rejects_bad_inputs(change, error, match):
    args = dict(
        combine_rows=torch.zeros(12, 16, dtype=torch.bfloat16, device=DEVICE),
        expert_ids=torch.zeros(5, 2, dtype=torch.int64, device=DEVICE),
        scores=torch.zeros(5, 2, device=DEVICE),
        y_out=poisoned(5, 16),
    )
    change(args)
    with pytest.raises(error, match=match):
        combine(**args)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def test_configs():
    w13 = W13Config.from_heuristic(hidden=4096, ffn=2048)
    assert (w13.block_m, w13.block_n, w13.block_k, w13.num_warps) == (128, 128, 64, 8)
    assert 3 <= w13.num_stages <= 4 and w13.fits_hopper()
    w2 = W2Config.from_heuristic(hidden=4096, ffn=2048)
    assert (w2.block_m, w2.block_n, w2.block_k, w2.num_warps) == (128, 128, 64, 8)
    assert w2.fits_hopper()
    assert w13.host_descriptors and w2.host_descriptors and not (w13.persistent or w2.persistent)
    for cls in (W13Config, W2Config):
        configs = cls.all_configs(block_m=128)
        assert configs and all(c.fits_hopper() and c.block_m == 128 for c in configs)
    assert CombineConfig.all_configs()
    with pytest.raises(ValueError, match=r"block_k \(48\) must be a power of two"):
        W13Config(block_k=48)
    with pytest.raises(ValueError, match=r"num_warps \(2\) must be 4 or 8"):
        W2Config(num_warps=2)
    with pytest.raises(TypeError):
        W2Config(128)  # keyword-only


# --------------------------------------------------------------------------------------------
# Whole forward on one rank: gather + W13 + SwiGLU -> W2 scatter -> combine
# --------------------------------------------------------------------------------------------


def run_forward_chain(num_tokens, top_k, num_experts, hidden, ffn, *, block_m, w13_config=None, w2_config=None):  # fmt: skip
    """Route, run the three kernels, and compare with an fp64 MoE of the same bf16 inputs.

    The chain rounds to bf16 three times (h2, h3, y), each a relative error of at most 2^-8,
    so per element (first order, fp32 accumulation error negligible beside it):
        |y - y64| <= 2^-8 |y64| + sum_k s_k 2^-8 (|h3_k| + |h2_k| @ |w2_e|^T)
    The test allows twice that (2^-7: a correctly rounded value may sit half an ulp off the
    fp32 result, which itself differs from fp64), plus 1e-4 of the output scale for
    accumulation-order noise in elements that cancel to near zero.
    """
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(torch.bfloat16)
    expert_ids = torch.randint(0, num_experts, (num_tokens, top_k), device=DEVICE)
    expert_ids[torch.rand(num_tokens, top_k, device=DEVICE) < 0.2] = -1
    scores = torch.rand(num_tokens, top_k, device=DEVICE)
    scores = torch.where(expert_ids >= 0, scores, 0.0)
    w13, w2 = random_weights(num_experts, hidden, ffn)

    # Routing tables (host-side here; the routing layer builds them on the device).
    ids = expert_ids.cpu()
    counts = [int((ids == e).sum()) for e in range(num_experts)]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + math.ceil(n / block_m) * block_m)
    r_cap = math.ceil(num_tokens * top_k / block_m) * block_m + num_experts * block_m
    combine_rows = poisoned(num_tokens * top_k, hidden)
    gather_ptrs = torch.zeros(r_cap, dtype=torch.int64)
    scatter_ptrs = torch.zeros(r_cap, dtype=torch.int64)
    fill = list(offsets[:-1])
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e < 0:
                continue
            gather_ptrs[fill[e]] = addr(x, t, hidden)
            scatter_ptrs[fill[e]] = addr(combine_rows, t * top_k + k, hidden)
            fill[e] += 1
    padded_offsets = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    gather_ptrs, scatter_ptrs = gather_ptrs.to(DEVICE), scatter_ptrs.to(DEVICE)

    h2 = poisoned(r_cap, ffn)
    gather_w13_swiglu(gather_ptrs, padded_offsets, w13, h2, config=w13_config, block_m=block_m)
    w2_scatter(h2, padded_offsets, w2, scatter_ptrs, config=w2_config, block_m=block_m)
    y = combine(combine_rows, expert_ids, scores, poisoned(num_tokens, hidden))

    # fp64 layer and the first-order bound of the three bf16 roundings.
    y64 = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    routed_mag = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    x64, w13_64, w2_64 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e < 0:
                continue
            g = x64[t] @ w13_64[e, 0].T
            u = x64[t] @ w13_64[e, 1].T
            h2_64 = torch.nn.functional.silu(g) * u
            h3_64 = h2_64 @ w2_64[e].T
            s = float(scores[t, k])
            y64[t] += s * h3_64
            routed_mag[t] += s * (h3_64.abs() + h2_64.abs() @ w2_64[e].abs().T)
    bound = 2**-7 * (y64.abs() + routed_mag) + 1e-4 * y64.abs().max()
    err = (y.double().cpu() - y64).abs()
    assert not torch.isnan(y).any()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} elements out of the rounding bound, max err {err.max().item():.3g}"
    )
    none_active = (ids < 0).all(dim=1)
    assert torch.equal(y[none_active.to(DEVICE)].float().cpu(), torch.zeros(int(none_active.sum()), hidden))  # fmt: skip


def test_forward_chain_one_rank():
    # 11 tokens (odd, less than a row block per expert on average), K=2, 5 experts (prime).
    run_forward_chain(11, 2, 5, 32, 48, block_m=BM, w13_config=W13_SMALL, w2_config=W2_SMALL)


# --------------------------------------------------------------------------------------------
# GPU: Hopper tile sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@GRIDS
def test_gpu_w13_hopper_tiles(persistent, host_descriptors):
    # Default 128x128x64 tiles, F=768 (6 column tiles), skewed experts incl. an empty one.
    config = W13Config.from_heuristic(hidden=1024, ffn=768)
    config = replace(config, persistent=persistent, host_descriptors=host_descriptors)
    counts = [300, 0, 129, 1000, 1, 64, 128, 511]
    r_cap = sum(math.ceil(n / 128) * 128 for n in counts) + 3 * 128
    run_w13_case(counts, hidden=1024, ffn=768, r_cap=r_cap, config=config)


@pytest.mark.gpu
@GRIDS
def test_gpu_w2_scatter_hopper_tiles(persistent, host_descriptors):
    # Default tiles, an empty expert padded to a whole null tile, two idle tiles.
    config = W2Config.from_heuristic(hidden=1024, ffn=768)
    config = replace(config, persistent=persistent, host_descriptors=host_descriptors)
    counts = [300, 0, 129, 700, 1, 64]
    r_cap = sum(math.ceil(n / 128) * 128 for n in counts) + 2 * 128
    run_w2_case(counts, hidden=1024, ffn=768, r_cap=r_cap, config=config, min_rows=[0, 128, 0, 0, 0, 0])  # fmt: skip


@pytest.mark.gpu
def test_gpu_forward_chain():
    run_forward_chain(256, 4, 8, 512, 384, block_m=128)


@pytest.mark.gpu
def test_gpu_combine_large():
    run_combine_case(1000, 1024, 8, 4096, id_dtype=torch.int16, score_dtype=torch.float32, config=None)  # fmt: skip


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_routing():
    # Capture W13 and W2 once; new routing tables written in place replay correctly (grids
    # depend on R_cap only, counts are read on the device); unaddressed rows stay untouched.
    hidden, ffn, num_experts, r_cap = 256, 256, 4, 1024
    w13, w2 = random_weights(num_experts, hidden, ffn)
    x = torch.randn(64, hidden, device=DEVICE).to(torch.bfloat16)
    gather_ptrs = torch.zeros(r_cap, dtype=torch.int64, device=DEVICE)
    scatter_ptrs = torch.zeros(r_cap, dtype=torch.int64, device=DEVICE)
    padded_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE)
    h2 = torch.zeros(r_cap, ffn, dtype=torch.bfloat16, device=DEVICE)
    out = torch.zeros(r_cap, hidden, dtype=torch.bfloat16, device=DEVICE)

    def forward():
        gather_w13_swiglu(gather_ptrs, padded_offsets, w13, h2)
        w2_scatter(h2, padded_offsets, w2, scatter_ptrs)

    forward()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for counts in ([64, 0, 200, 3], [0, 500, 1, 0]):
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + math.ceil(n / 128) * 128)
        g = torch.zeros(r_cap, dtype=torch.int64)
        s = torch.zeros(r_cap, dtype=torch.int64)
        src_rows = torch.zeros(r_cap, dtype=torch.int64)
        for e, n in enumerate(counts):
            for i in range(n):
                r = offsets[e] + i
                src_rows[r] = int(torch.randint(64, ()))
                g[r] = addr(x, int(src_rows[r]), hidden)
                s[r] = addr(out, r, hidden)
        gather_ptrs.copy_(g)
        scatter_ptrs.copy_(s)
        padded_offsets.copy_(torch.tensor(offsets, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        is_live = torch.zeros(r_cap, dtype=torch.bool)
        for e, n in enumerate(counts):
            is_live[offsets[e] : offsets[e] + n] = True
        assert_untouched(out[(~is_live).to(DEVICE)], what="rows no live row points at")
        for e, n in enumerate(counts):
            if n == 0:  # an empty expert has no rows to check (its idle rows are checked above)
                continue
            rows = slice(offsets[e], offsets[e] + n)
            xe = x[src_rows[rows].to(DEVICE)].double()
            h2_64 = torch.nn.functional.silu(xe @ w13[e, 0].double().T) * (
                xe @ w13[e, 1].double().T
            )
            w2_64 = w2[e].double()
            h3_64 = h2_64 @ w2_64.T
            # Two bf16 roundings (h2, h3): first-order bound as in run_forward_chain.
            bound = 2**-7 * (h3_64.abs() + h2_64.abs() @ w2_64.abs().T) + 1e-4 * h3_64.abs().max()
            err = (out[rows].double() - h3_64).abs()
            assert not torch.isnan(out[rows]).any() and bool((err <= bound).all()), (
                f"replay with counts {counts}: expert {e} max err {err.max().item():.3g}"
            )
