"""Backward kernels (route_grad, w2_backward, w13_backward) against plain-PyTorch references.

Every kernel output is poisoned (NaN) before the run: rows a kernel must not write keep their
poison bit for bit, and rows it must not read are NaN in its inputs, so reading them shows up
as NaN in a compared output. The chain test runs all six kernels on one small problem and
compares grad_x, grad_scores, grad_w13 and grad_w2 with torch autograd of the fp64 reference
layer (distmoe.reference.moe_reference) on the same bf16 inputs.

Without CUDA the kernels run through Triton's interpreter at small shapes.
"""

from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

INTERPRETED = use_interpreter_if_no_gpu()

import math  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.route_grad import (  # noqa: E402
    RouteGradConfig,
    reduce_routes,
    reduce_routes_ref,
    route_grads,
    route_grads_ref,
)
from distmoe.kernels.w2_backward import (  # noqa: E402
    W2DgradConfig,
    WgradConfig,
    w2_dgrad_swiglu_bwd,
    w2_dgrad_swiglu_bwd_ref,
    w2_wgrad,
    w2_wgrad_ref,
)
from distmoe.kernels.w13_backward import (  # noqa: E402
    W13DgradConfig,
    w13_dgrad_scatter,
    w13_dgrad_scatter_ref,
    w13_wgrad,
    w13_wgrad_ref,
)
from distmoe.reference import moe_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# One fp32 -> bf16 rounding (to nearest even, on the GPU and, through the correction in
# distmoe.kernels.interpreter, in the interpreter) is off by at most half a bf16 spacing:
# 2^-8 relative at most.
ROUNDING_REL = 2.0**-8


@pytest.fixture(autouse=True)
def _seed(request):
    # Overrides the suite-wide seed fixture: str hash() is salted per process, crc32 is not,
    # so a failure here reproduces with the same data.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# --------------------------------------------------------------------------------------------
# Helpers: routing layouts, pointer tables, poison
# --------------------------------------------------------------------------------------------


def poisoned(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN poison included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, *, floor: float = 1e-5):
    """``actual`` (bf16, rounded once from an fp32 result) against an fp32/fp64 reference:
    the rounding costs at most ``ROUNDING_REL`` relative; ``floor`` (relative to the largest
    reference value) absorbs fp32 accumulation-order and sigmoid differences near zero."""
    expected = expected.double().cpu()
    actual = actual.double().cpu()
    assert torch.isfinite(actual).all(), "kernel output holds NaN/inf"
    scale = expected.abs().max().item() or 1.0
    bound = ROUNDING_REL * expected.abs() + floor * scale
    excess = (actual - expected).abs() - bound
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e} (scale {scale:.3e})"


def make_ids(num_tokens: int, top_k: int, experts: list[int], *, inactive: float = 0.2):
    """[T, K] int64 ids: distinct experts per token drawn from ``experts``, about ``inactive``
    of the routes -1, and token 0 without any active route."""
    ids = torch.full((num_tokens, top_k), -1, dtype=torch.int64)
    for t in range(num_tokens):
        pick = torch.randperm(len(experts))[: min(top_k, len(experts))]
        ids[t, : pick.numel()] = torch.tensor(experts)[pick]
    ids[torch.rand(num_tokens, top_k) < inactive] = -1
    ids[0] = -1
    return ids


@dataclass
class Layout:
    """Padded expert-major rows of one rank (the routing layer's contract).

    padded_offsets: int32 [E + 1] on DEVICE; route_of_row: int64 [R_cap] on the CPU, route
    index ``t*K + k`` of each row, -1 for null rows and -2 for idle rows.
    """

    padded_offsets: torch.Tensor
    route_of_row: torch.Tensor
    num_rows: int

    @property
    def live_end(self) -> int:
        return int(self.padded_offsets[-1])

    @property
    def is_live(self) -> torch.Tensor:
        return self.route_of_row >= -1

    @property
    def is_route(self) -> torch.Tensor:
        return self.route_of_row >= 0


def build_layout(
    ids: torch.Tensor, num_experts: int, block_m: int, *, idle_tiles: int = 2, shuffle: bool = True
) -> Layout:
    """Each expert's routes padded with null rows to a multiple of ``block_m`` (null rows
    scattered inside the segment when ``shuffle``), then ``idle_tiles`` idle tiles."""
    flat = ids.reshape(-1)
    offsets = [0]
    rows = []
    for e in range(num_experts):
        routes = (flat == e).nonzero().reshape(-1)
        size = math.ceil(routes.numel() / block_m) * block_m
        seg = torch.cat([routes, torch.full((size - routes.numel(),), -1, dtype=torch.int64)])
        if shuffle:
            seg = seg[torch.randperm(size)]
        rows.append(seg)
        offsets.append(offsets[-1] + size)
    rows.append(torch.full((idle_tiles * block_m,), -2, dtype=torch.int64))
    route_of_row = torch.cat(rows)
    return Layout(
        torch.tensor(offsets, dtype=torch.int32, device=DEVICE), route_of_row, route_of_row.numel()
    )


def row_table(layout: Layout, buffer: torch.Tensor, *, idle_target: torch.Tensor | None = None):
    """int64 [R_cap] addresses of ``buffer`` rows (route index = row), 0 for null rows; idle
    rows point at rows of ``idle_target`` (kernels must never touch them) or are 0."""
    row_bytes = buffer.shape[-1] * buffer.element_size()
    route = layout.route_of_row
    table = torch.where(route >= 0, buffer.data_ptr() + route.clamp(min=0) * row_bytes, 0)
    if idle_target is not None:
        idle = (route == -2).nonzero().reshape(-1)
        target_rows = torch.arange(idle.numel()) % idle_target.shape[0]
        table[idle] = idle_target.data_ptr() + target_rows * row_bytes
    return table.to(DEVICE)


def gathered_rows(
    layout: Layout, source: torch.Tensor, *, top_k: int = 1, idle=float("nan")
) -> torch.Tensor:
    """``source[route // top_k]`` per row (``top_k`` = K: the route's token), zeros for null
    rows and ``idle`` for idle rows."""
    route = layout.route_of_row.to(DEVICE)
    out = source[route.clamp(min=0) // top_k].clone()
    out[route == -1] = 0
    out[route == -2] = idle
    return out


# --------------------------------------------------------------------------------------------
# route_grads / reduce_routes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hidden,block_d,top_k",
    [
        (40, 16, 3),  # D tail in the last step
        (64, 64, 1),
    ],  # one step; K = 1
)
def test_route_grads(hidden, block_d, top_k):
    num_tokens, t_max = 7, 9  # odd T; buffers sized for T_max > T
    ids = make_ids(num_tokens, top_k, [0, 1, 2, 3]).to(torch.int16).to(DEVICE)  # int16 ids
    active = ids.long().reshape(-1) >= 0
    scores = torch.rand(num_tokens, top_k, device=DEVICE) * (ids >= 0)
    grad_y = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    h3 = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    h3[: num_tokens * top_k][~active] = float("nan")  # inactive routes: never read
    grad_routes = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    before = grad_routes.clone()
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)

    config = RouteGradConfig(block_rows=4, block_d=block_d, num_warps=4)
    route_grads(grad_y, h3, ids, scores, grad_routes, grad_scores, config=config)

    ref_routes, ref_scores = route_grads_ref(grad_y, h3, ids, scores)
    # grad_routes: one fp32 product rounded to bf16, so bit-exact.
    n = num_tokens * top_k
    assert same_bits(grad_routes[:n][active], ref_routes[active].bfloat16())
    assert same_bits(grad_routes[:n][~active], before[:n][~active])  # inactive: not written
    assert same_bits(grad_routes[n:], before[n:])  # beyond T*K: not written
    # grad_scores: fp32 sums of exact bf16 products; only the summation order differs.
    torch.testing.assert_close(grad_scores, ref_scores.float(), rtol=1e-5, atol=1e-5)
    assert (grad_scores.reshape(-1)[~active] == 0).all()


def test_reduce_routes():
    num_tokens, top_k, t_max, hidden = 9, 4, 10, 48
    ids = make_ids(num_tokens, top_k, [0, 1, 2, 3, 4]).to(DEVICE)
    active = ids.reshape(-1) >= 0
    rows = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    rows[: num_tokens * top_k][~active] = float("nan")  # inactive: never read
    grad_x = poisoned(num_tokens, hidden)

    reduce_routes(rows, ids, grad_x, config=RouteGradConfig(block_rows=4, block_d=32))

    # fp32 sum of at most K bf16 rows, one rounding to bf16.
    assert_bf16_close(grad_x, reduce_routes_ref(rows, ids))
    assert same_bits(grad_x[0], torch.zeros(hidden, dtype=torch.bfloat16, device=DEVICE))


# --------------------------------------------------------------------------------------------
# W2 DGRAD + SwiGLU backward
# --------------------------------------------------------------------------------------------


def _w2_problem(hidden, ffn, block_m, *, one_expert=False):
    num_experts, num_tokens, top_k, t_max = 4, 11, 3, 12
    experts = [2] if one_expert else [0, 1, 2]  # expert 3 (and 0, 1) may get zero rows
    ids = make_ids(num_tokens, top_k, experts)
    layout = build_layout(ids, num_experts, block_m)
    combine = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    route = layout.route_of_row.to(DEVICE)
    unrouted = torch.ones(combine.shape[0], dtype=torch.bool, device=DEVICE)
    unrouted[route[route >= 0]] = False
    combine[unrouted] = float("nan")  # rows no table entry names: never read
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    h1 = torch.randn(layout.num_rows, 2 * ffn, device=DEVICE).bfloat16() * 2
    h1[route < 0] = float("nan")  # null and idle rows of h1: never read
    return layout, combine, w2, h1


@pytest.mark.parametrize(
    "mode",
    [
        "gather_once",  # grad_h3_out given: row gather launch, then TMA-fed GEMM
        "gather_in_loop",  # no grad_h3_out: pointer gather inside the K loop
        "in_place",  # grad_h1_out is h1
        "one_expert",  # every route to one expert
        "grad_h1_only",  # neither h2_out nor grad_h3_out
        "narrow_tiles",  # block_n 16: the epilogue without column halves
        "device_descriptors",
    ],  # TMA descriptors built in the kernel, not on the host
)
def test_w2_dgrad_swiglu_bwd(mode):
    hidden, ffn, block_m = 48, 40, 16  # D and F not multiples of the tiles: masked tails
    layout, combine, w2, h1 = _w2_problem(hidden, ffn, block_m, one_expert=mode == "one_expert")
    ptrs = row_table(layout, combine, idle_target=combine)
    rows = layout.num_rows
    h1_saved = h1.clone()
    grad_h1 = h1 if mode == "in_place" else poisoned(rows, 2 * ffn)
    h2 = None if mode == "grad_h1_only" else poisoned(rows, ffn)
    grad_h3 = None if mode in ("gather_in_loop", "grad_h1_only") else poisoned(rows, hidden)
    block_n = 16 if mode == "narrow_tiles" else 32
    config = W2DgradConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=block_n,
        num_warps=4,
        group_m=2,
        host_descriptors=mode != "device_descriptors",
    )

    w2_dgrad_swiglu_bwd(
        ptrs, layout.padded_offsets, w2, h1, grad_h1, h2_out=h2, grad_h3_out=grad_h3, config=config
    )

    ref_grad_h1, ref_h2, ref_grad_h3 = w2_dgrad_swiglu_bwd_ref(
        ptrs, layout.padded_offsets, w2, h1_saved, row_sources=[combine]
    )
    live = layout.is_live.to(DEVICE)
    idle = ~live
    # grad_h1 and h2: an fp32 GEMM plus fp32 SwiGLU terms, rounded to bf16 once.
    assert_bf16_close(grad_h1[live], ref_grad_h1[live])
    if mode == "in_place":
        assert same_bits(grad_h1[idle], h1_saved[idle])
    else:
        assert same_bits(grad_h1[idle], poisoned(int(idle.sum()), 2 * ffn))
    null = (layout.route_of_row == -1).to(DEVICE)
    assert (grad_h1[null] == 0).all()
    if h2 is not None:
        assert_bf16_close(h2[live], ref_h2[live])
        assert (h2[null] == 0).all()
        assert same_bits(h2[idle], poisoned(int(idle.sum()), ffn))
    if grad_h3 is not None:  # data movement: bit-exact, zeros for null rows
        assert same_bits(grad_h3[live], ref_grad_h3[live].bfloat16())
        assert same_bits(grad_h3[idle], poisoned(int(idle.sum()), hidden))


# --------------------------------------------------------------------------------------------
# W13 DGRAD + scatter
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "one_expert,host_descriptors",
    [
        (False, True),
        (True, True),  # every route to one expert
        (False, False),
    ],  # TMA descriptors built in the kernel
)
def test_w13_dgrad_scatter(one_expert, host_descriptors):
    num_experts, num_tokens, top_k, t_max = 5, 11, 3, 12  # prime E
    hidden, ffn, block_m = 40, 24, 16  # 2F = 48: a K tail with block_k 32; D tail too
    ids = make_ids(num_tokens, top_k, [1] if one_expert else [0, 1, 4])  # 2, 3: no rows
    layout = build_layout(ids, num_experts, block_m)
    w13 = (torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    grad_h1 = torch.randn(layout.num_rows, 2 * ffn, device=DEVICE).bfloat16()
    grad_h1[~layout.is_live.to(DEVICE)] = float("nan")  # idle rows: never read
    dispatch = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    canary = torch.randn(3, hidden, device=DEVICE).bfloat16()  # idle rows' table entries
    dispatch_before, canary_before = dispatch.clone(), canary.clone()
    ptrs = row_table(layout, dispatch, idle_target=canary)

    config = W13DgradConfig(
        block_m=block_m, block_n=32, block_k=32, num_warps=4, host_descriptors=host_descriptors
    )
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, w13, ptrs, config=config)

    ref = w13_dgrad_scatter_ref(grad_h1, layout.padded_offsets, w13)
    is_route = layout.is_route.to(DEVICE)
    targets = layout.route_of_row.to(DEVICE)[is_route]
    # One fp32 GEMM rounded to bf16.
    assert_bf16_close(dispatch[targets], ref[is_route])
    untouched = torch.ones(dispatch.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[targets] = False  # inactive routes and rows beyond T*K: not written
    assert untouched.any()
    assert same_bits(dispatch[untouched], dispatch_before[untouched])
    assert same_bits(canary, canary_before)


# --------------------------------------------------------------------------------------------
# WGRAD (W2 and W13)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split_rows", [1, 3])
@pytest.mark.parametrize("one_expert", [False, True])
def test_w2_wgrad(split_rows, one_expert):
    num_experts, hidden, ffn, block_m = 4, 48, 40, 16
    ids = make_ids(13, 3, [3] if one_expert else [0, 2, 3])  # expert 1 has no rows
    layout = build_layout(ids, num_experts, block_m)
    live = layout.is_live.to(DEVICE)
    null = (layout.route_of_row == -1).to(DEVICE)
    grad_h3 = torch.randn(layout.num_rows, hidden, device=DEVICE).bfloat16()
    h2 = torch.randn(layout.num_rows, ffn, device=DEVICE).bfloat16()
    grad_h3[null], h2[null] = 0, 0  # as the DGRAD writes them
    grad_h3[~live], h2[~live] = float("nan"), float("nan")  # idle rows: never read
    grad_w2 = torch.randn(num_experts, hidden, ffn, device=DEVICE)  # existing .grad
    before = grad_w2.clone()
    config = WgradConfig(
        block_m=block_m,
        block_k=16,
        block_out_m=32,
        block_out_n=32,
        split_rows=split_rows,
        num_warps=4,
        num_stages=2,
    )

    w2_wgrad(grad_h3, h2, layout.padded_offsets, grad_w2, config=config)

    # fp32 sums of exact bf16 products on both sides: only the summation order differs.
    torch.testing.assert_close(
        grad_w2, w2_wgrad_ref(grad_h3, h2, layout.padded_offsets, before), rtol=1e-5, atol=1e-4
    )
    offsets = layout.padded_offsets.tolist()
    for e in range(num_experts):
        if offsets[e + 1] == offsets[e]:  # experts without rows: bit-exact untouched
            assert same_bits(grad_w2[e], before[e])


@pytest.mark.parametrize(
    "split_rows,host_descriptors",
    [(1, True), (2, False)],  # split rows with atomics; TMA descriptors built in the kernel
)
def test_w13_wgrad(split_rows, host_descriptors):
    num_experts, hidden, ffn, block_m = 3, 40, 24, 32
    ids = make_ids(20, 2, [0, 2])  # expert 1 has no rows
    layout = build_layout(ids, num_experts, block_m, idle_tiles=1)
    live = layout.is_live.to(DEVICE)
    null = (layout.route_of_row == -1).to(DEVICE)
    grad_h1 = torch.randn(layout.num_rows, 2 * ffn, device=DEVICE).bfloat16()
    x = torch.randn(layout.num_rows, hidden, device=DEVICE).bfloat16()
    grad_h1[null], x[null] = 0, 0
    grad_h1[~live], x[~live] = float("nan"), float("nan")
    grad_w13 = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    before = grad_w13.clone()
    config = WgradConfig(
        block_m=block_m,
        block_k=16,
        block_out_m=32,
        block_out_n=16,
        split_rows=split_rows,
        num_warps=4,
        num_stages=2,
        host_descriptors=host_descriptors,
    )

    w13_wgrad(grad_h1, x, layout.padded_offsets, grad_w13, config=config)

    torch.testing.assert_close(
        grad_w13, w13_wgrad_ref(grad_h1, x, layout.padded_offsets, before), rtol=1e-5, atol=1e-4
    )
    assert same_bits(grad_w13[1], before[1])


# --------------------------------------------------------------------------------------------
# The whole backward chain against autograd
# --------------------------------------------------------------------------------------------


def _run_chain(x, ids, scores, w13, w2, grad_y, *, block_m, configs, t_max):
    """Saved forward state from the fp64 reference rounded to bf16 (what the forward kernels
    keep), then the six backward kernels in order. Returns (grad_x, grad_scores, grad_w13,
    grad_w2 increments)."""
    num_tokens, top_k = ids.shape
    num_experts, _, ffn, hidden = w13.shape
    layout = build_layout(ids.cpu(), num_experts, block_m)
    route = layout.route_of_row.to(DEVICE)
    offsets = layout.padded_offsets.tolist()

    # Forward state: x_gathered, h1 (bf16, null rows zero), h3 per route slot (bf16).
    x_gathered = gathered_rows(layout, x, top_k=top_k)
    h1_exact = torch.zeros(layout.num_rows, 2 * ffn, dtype=torch.float64, device=DEVICE)
    h3_exact = torch.zeros(layout.num_rows, hidden, dtype=torch.float64, device=DEVICE)
    for e in range(num_experts):
        rows = slice(offsets[e], offsets[e + 1])
        h1_exact[rows] = x_gathered[rows].double() @ w13[e].double().reshape(2 * ffn, hidden).t()
        g, u = h1_exact[rows, :ffn], h1_exact[rows, ffn:]
        h3_exact[rows] = (torch.nn.functional.silu(g) * u) @ w2[e].double().t()
    h1 = h1_exact.bfloat16()
    h1[route == -1] = 0
    h1[route == -2] = float("nan")
    h3_routes = poisoned(t_max * top_k, hidden)
    h3_routes[route[route >= 0]] = h3_exact[route >= 0].bfloat16()

    # Owner buffers (combine / dispatch) and outputs, poisoned.
    combine = poisoned(t_max * top_k, hidden)
    dispatch = poisoned(t_max * top_k, hidden)
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    grad_x = poisoned(num_tokens, hidden)
    grad_h3 = poisoned(layout.num_rows, hidden)
    h2 = poisoned(layout.num_rows, ffn)
    grad_w2_before = torch.randn(num_experts, hidden, ffn, device=DEVICE)
    grad_w13_before = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    grad_w2, grad_w13 = grad_w2_before.clone(), grad_w13_before.clone()

    route_grads(grad_y, h3_routes, ids, scores, combine, grad_scores)
    w2_dgrad_swiglu_bwd(
        row_table(layout, combine),
        layout.padded_offsets,
        w2,
        h1,
        h1,
        h2_out=h2,
        grad_h3_out=grad_h3,
        config=configs["w2_dgrad"],
    )
    grad_h1 = h1  # in place
    w2_wgrad(grad_h3, h2, layout.padded_offsets, grad_w2, config=configs["w2_wgrad"])
    w13_dgrad_scatter(
        grad_h1,
        layout.padded_offsets,
        w13,
        row_table(layout, dispatch),
        config=configs["w13_dgrad"],
    )
    w13_wgrad(grad_h1, x_gathered, layout.padded_offsets, grad_w13, config=configs["w13_wgrad"])
    reduce_routes(dispatch, ids, grad_x)
    return grad_x, grad_scores, grad_w13 - grad_w13_before, grad_w2 - grad_w2_before


def _autograd_grads(x, ids, scores, w13, w2, grad_y, dtype):
    leaves = [
        x.to(dtype),
        scores.to(torch.float64 if dtype == torch.float64 else torch.float32),
        w13.to(dtype),
        w2.to(dtype),
    ]
    leaves = [t.detach().requires_grad_() for t in leaves]
    y = moe_reference(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y.backward(grad_y.to(y.dtype))
    return [t.grad.double().cpu() for t in leaves]


def _chain_check(num_tokens, top_k, num_experts, experts, hidden, ffn, block_m, configs):
    t_max = num_tokens + 2
    x = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    ids = make_ids(num_tokens, top_k, experts).to(DEVICE)
    scores = torch.rand(num_tokens, top_k, device=DEVICE) * (ids >= 0)
    w13 = (torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    grad_y = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()

    ours = _run_chain(
        x, ids, scores, w13, w2, grad_y, block_m=block_m, configs=configs, t_max=t_max
    )
    exact = _autograd_grads(x, ids, scores, w13, w2, grad_y, torch.float64)
    torch_bf16 = _autograd_grads(x, ids, scores, w13, w2, grad_y, torch.bfloat16)
    names = ("grad_x", "grad_scores", "grad_w13", "grad_w2")
    for name, got, ref, base in zip(names, ours, exact, torch_bf16, strict=True):
        got = got.double().cpu()
        assert torch.isfinite(got).all(), f"{name} holds NaN/inf"
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item() / scale
        base_err = (base - ref).abs().max().item() / scale
        # The rule of the suite: at most 2x the error of torch autograd in bf16 (same bf16
        # saved state and gradients, fp32 scores); 2e-3 of the largest value floors it for
        # outputs where torch's bf16 path happens to be nearly exact (a handful of bf16
        # roundings of relative 2^-9 each, chained).
        assert err <= max(2 * base_err, 2e-3), f"{name}: error {err:.2e}, torch bf16 {base_err:.2e}"
    assert (ours[0][0] == 0).all()  # token 0 has no active route: exact zeros


def test_backward_chain():
    block_m = 16
    configs = {
        "w2_dgrad": W2DgradConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4),
        "w2_wgrad": WgradConfig(
            block_m=block_m, block_k=16, block_out_m=32, block_out_n=32, num_warps=4
        ),
        "w13_dgrad": W13DgradConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4),
        "w13_wgrad": WgradConfig(
            block_m=block_m, block_k=16, block_out_m=32, block_out_n=32, num_warps=4
        ),
    }
    # Expert 3 receives no rows; inactive routes; T not a multiple of the row block.
    _chain_check(
        num_tokens=13,
        top_k=3,
        num_experts=4,
        experts=[0, 1, 2],
        hidden=64,
        ffn=32,
        block_m=block_m,
        configs=configs,
    )


@pytest.mark.gpu
def test_backward_chain_gpu_default_configs():
    # Production tiles (block_m 128, 128-wide tiles, 8 warps, TMA, pipelined row loops).
    configs = {
        "w2_dgrad": W2DgradConfig.from_heuristic(hidden=512, ffn=384),
        "w2_wgrad": WgradConfig.from_heuristic(out_rows=512, out_cols=384),
        "w13_dgrad": W13DgradConfig.from_heuristic(hidden=512, ffn=384),
        "w13_wgrad": WgradConfig.from_heuristic(out_rows=768, out_cols=512),
    }
    _chain_check(
        num_tokens=300,
        top_k=4,
        num_experts=6,
        experts=[0, 1, 2, 4, 5],
        hidden=512,
        ffn=384,
        block_m=128,
        configs=configs,
    )


# --------------------------------------------------------------------------------------------
# Configurations and input validation
# --------------------------------------------------------------------------------------------


def test_configs():
    for cfg in W2DgradConfig.all_configs(hidden=4096, ffn=2048):
        assert cfg.fits_hopper() and cfg.block_m == 128
    for cfg in W13DgradConfig.all_configs(hidden=7168, ffn=768, block_m=64):
        assert cfg.fits_hopper() and cfg.block_m == 64
    for cfg in WgradConfig.all_configs(out_rows=4096, out_cols=2048, block_m=64):
        assert cfg.fits_hopper() and 64 % cfg.block_k == 0
    assert RouteGradConfig.all_configs(hidden=40)
    big = WgradConfig.from_heuristic(out_rows=4096, out_cols=2048)
    assert (big.block_out_m, big.block_out_n, big.num_warps) == (128, 128, 8)
    assert W2DgradConfig.from_heuristic(hidden=4096, ffn=2048).block_n == 128
    with pytest.raises(ValueError, match=r"block_k \(64\) must divide block_m \(32\)"):
        WgradConfig(block_m=32, block_k=64)
    with pytest.raises(ValueError, match=r"persistent \(True\) is not supported"):
        W2DgradConfig(persistent=True)


def test_validation_errors():
    ffn, hidden, rows = 16, 32, 32
    w2 = torch.zeros(2, hidden, ffn, dtype=torch.bfloat16, device=DEVICE)
    ptrs = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    h1 = torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    cfg = W2DgradConfig(block_m=16, block_n=16, block_k=16, num_warps=4)
    with pytest.raises(TypeError, match=r"grad_h3_ptrs must have dtype int64, got torch.int32"):
        w2_dgrad_swiglu_bwd(ptrs.int(), offsets, w2, h1, h1.clone(), config=cfg)
    with pytest.raises(
        ValueError, match=r"h1 must have shape \[32, 32\] \[R_cap, 2F\], got \[32, 24\]"
    ):
        w2_dgrad_swiglu_bwd(ptrs, offsets, w2, h1[:, :24], h1.clone(), config=cfg)
    with pytest.raises(ValueError, match=r"R_cap \(24\) must be a multiple of config.block_m"):
        w2_dgrad_swiglu_bwd(ptrs[:24], offsets, w2, h1[:24], h1[:24].clone(), config=cfg)
    scratch = torch.zeros(rows * 3 * ffn, dtype=torch.bfloat16, device=DEVICE)
    grad_h1 = scratch[: rows * 2 * ffn].view(rows, 2 * ffn)
    h2_overlapping = scratch[rows * ffn : rows * 2 * ffn].view(rows, ffn)
    with pytest.raises(ValueError, match=r"grad_h1_out and h2_out must not overlap in memory"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, w2, h1, grad_h1, h2_out=h2_overlapping, config=cfg)
    with pytest.raises(ValueError, match=r"padded_offsets must have shape \[3\]"):
        w2_dgrad_swiglu_bwd(ptrs, offsets[:2], w2, h1, h1.clone(), config=cfg)
    with pytest.raises(TypeError, match=r"config must be a W2DgradConfig"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, w2, h1, h1.clone(), config=WgradConfig())
    with pytest.raises(ValueError, match=r"F \(w2.shape\[2\]\) \(12\) must be a positive multiple"):
        w2_dgrad_swiglu_bwd(
            ptrs,
            offsets,
            w2[..., :12].contiguous(),
            h1[:, :24].contiguous(),
            h1[:, :24].contiguous(),
            config=cfg,
        )
    grad_w2 = torch.zeros(2, hidden, ffn, device=DEVICE)
    with pytest.raises(TypeError, match=r"grad_w2 must have dtype float32, got torch.bfloat16"):
        w2_wgrad(
            torch.zeros(rows, hidden, dtype=torch.bfloat16, device=DEVICE),
            h1[:, :ffn],
            offsets,
            grad_w2.bfloat16(),
        )
    with pytest.raises(ValueError, match=r"h2 must be contiguous"):
        w2_wgrad(
            torch.zeros(rows, hidden, dtype=torch.bfloat16, device=DEVICE),
            h1[:, :ffn],
            offsets,
            grad_w2,
        )
    w13 = torch.zeros(2, 2, ffn, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"w13 must have shape \[E_local, 2, F, D\]"):
        w13_dgrad_scatter(h1, offsets, w13.reshape(2, 4, ffn // 2, hidden), ptrs)
    with pytest.raises(ValueError, match=r"scores must have shape \[4, 2\]"):
        ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
        route_grads(
            torch.zeros(4, hidden, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(8, hidden, dtype=torch.bfloat16, device=DEVICE),
            ids,
            torch.zeros(4, 3, device=DEVICE),
            torch.zeros(8, hidden, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(4, 2, device=DEVICE),
        )
    with pytest.raises(ValueError, match=r"route_rows must have shape \[R, 32\] with R >= T\*K"):
        reduce_routes(
            torch.zeros(7, hidden, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(4, 2, dtype=torch.int64, device=DEVICE),
            torch.zeros(4, hidden, dtype=torch.bfloat16, device=DEVICE),
        )
