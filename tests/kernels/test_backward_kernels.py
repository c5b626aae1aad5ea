"""Backward kernels (route_grad, w2_backward, w13_backward) against plain-PyTorch references.

Row layout under test: padded expert-major rows schedule the tiles and index the pointer
tables; activations are compact (``row_offsets``): expert ``e``'s ``n_e`` live rows come first
in its padded segment, padding rows follow and have no activation row. The layouts here have
row counts that are not multiples of ``block_m`` (padding in every segment), an empty expert
(no segment), an expert with a whole tile of padding rows, idle tiles after the last segment,
and spare activation rows past ``row_offsets[E_local]``.

Every kernel output is poisoned (NaN) before the run: rows a kernel must not write keep their
poison bit for bit, and rows it must not read are NaN in its inputs (spare activation rows
included), so reading them shows up as NaN in a compared output. Pointer-table entries of
padding and idle rows point at canary rows (NaN rows for W2 DGRAD, rows that W13 DGRAD must
leave untouched): kernels must not use those entries. The chain test runs all six kernels on
one small problem, with plain tensors and with the device-offset paths (h1_offset with grad_h1
in place, x_offset, h3_addr in place over the combine buffer), and compares grad_x,
grad_scores, grad_w13 and grad_w2 with torch autograd of the fp64 reference layer
(distmoe.reference.moe_reference) on the same bf16 inputs.

Without CUDA the kernels run through Triton's interpreter at small shapes. The interpreter runs
a program's operations one whole block at a time, so the in-place tests check the results of
the in-place paths, not the GPU's ordering of loads before stores within a program.
"""

from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

INTERPRETED = use_interpreter_if_no_gpu()

import math  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from functools import partial  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels._common import gemm_grid  # noqa: E402
from distmoe.kernels.route_grad import (  # noqa: E402
    RouteGradConfig,
    push_route_grads,
    reduce_routes,
    reduce_routes_ref,
    route_grads,
    route_grads_ref,
)
from distmoe.kernels.w2_backward import (  # noqa: E402
    W2DgradConfig,
    WgradConfig,
    compact_segments,
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


def assert_wgrad_close(actual, a, b, layout, before, *, rows_sum):
    """fp32 WGRAD against the reference, per element: both sides sum exact bf16 products in
    fp32 (at most ~50 terms plus ``before``), only in different orders, so each is within
    n * 2^-24 (< 1e-5 / 2) of the exact sum relative to ``|before| + sum |a_i b_i|``. The
    bound is computed from the operands, so experts whose rows are large keep their own
    scale: a row of the next (large) expert leaking into a small expert breaks it by orders
    of magnitude."""
    expected = rows_sum(a, b, layout.padded_offsets, layout.row_offsets, before)
    magnitude = rows_sum(a.abs(), b.abs(), layout.padded_offsets, layout.row_offsets, before.abs())
    assert torch.isfinite(actual).all(), "WGRAD output holds NaN/inf"
    excess = (actual - expected).abs() - 1e-5 * magnitude
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e}"


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
    """Padded tile schedule + compact activation rows of one rank (the routing contract).

    padded_offsets / row_offsets: int32 [E + 1] on DEVICE. route_of_row: int64 [R_cap] on the
    CPU, route index ``t*K + k`` of each live padded row, -1 for padding rows and -2 for idle
    rows. act_of_row: activation row of each live padded row (-1 elsewhere). route_of_act:
    int64 [R_act], route of each activation row, -2 for spare rows past the live end.
    """

    padded_offsets: torch.Tensor
    row_offsets: torch.Tensor
    route_of_row: torch.Tensor
    act_of_row: torch.Tensor
    route_of_act: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.route_of_row.numel()

    @property
    def num_act(self) -> int:
        return self.route_of_act.numel()

    @property
    def live_end(self) -> int:
        return int(self.row_offsets[-1])

    @property
    def is_live(self) -> torch.Tensor:
        """[R_cap] live padded rows."""
        return self.route_of_row >= 0

    def live_act(self, device=DEVICE) -> torch.Tensor:
        """[R_act] activation rows below ``row_offsets[E]``."""
        return (torch.arange(self.num_act) < self.live_end).to(device)


def layout_from_routes(
    routes: list[torch.Tensor],
    block_m: int,
    *,
    idle_tiles: int = 2,
    extra_tiles: dict[int, int] | None = None,
    spare_rows: int = 3,
) -> Layout:
    """``routes[e]``: route indices of expert ``e`` (its activation rows, in order). Each
    segment is padded to a multiple of ``block_m`` (plus ``extra_tiles[e]`` whole tiles of
    padding rows), then ``idle_tiles`` idle tiles; ``spare_rows`` activation rows follow the
    live ones."""
    extra_tiles = extra_tiles or {}
    padded, rows, act_of_row = [0], [0], []
    route_of_row = []
    for e, r in enumerate(routes):
        count = r.numel()
        size = (math.ceil(count / block_m) + extra_tiles.get(e, 0)) * block_m
        route_of_row.append(torch.cat([r, torch.full((size - count,), -1, dtype=torch.int64)]))
        act_of_row.append(
            torch.cat([rows[-1] + torch.arange(count), torch.full((size - count,), -1)])
        )
        padded.append(padded[-1] + size)
        rows.append(rows[-1] + count)
    route_of_row.append(torch.full((idle_tiles * block_m,), -2, dtype=torch.int64))
    act_of_row.append(torch.full((idle_tiles * block_m,), -1, dtype=torch.int64))
    route_of_act = torch.cat([*routes, torch.full((spare_rows,), -2, dtype=torch.int64)])
    layout = Layout(
        torch.tensor(padded, dtype=torch.int32, device=DEVICE),
        torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        torch.cat(route_of_row),
        torch.cat(act_of_row),
        route_of_act,
    )
    compact_segments(layout.padded_offsets, layout.row_offsets)  # the layout obeys the rules
    return layout


def build_layout(ids: torch.Tensor, num_experts: int, block_m: int, **kwargs) -> Layout:
    """Each expert's routes (shuffled) as its live rows; see :func:`layout_from_routes`."""
    flat = ids.reshape(-1).cpu()
    routes = []
    for e in range(num_experts):
        r = (flat == e).nonzero().reshape(-1)
        routes.append(r[torch.randperm(r.numel())])
    return layout_from_routes(routes, block_m, **kwargs)


def layout_from_counts(counts: list[int], block_m: int, **kwargs) -> Layout:
    """Live row counts per expert (route indices 0, 1, ... in order)."""
    starts = [sum(counts[:e]) for e in range(len(counts))]
    routes = [torch.arange(s, s + c) for s, c in zip(starts, counts, strict=True)]
    return layout_from_routes(routes, block_m, **kwargs)


def row_table(
    layout: Layout,
    buffer: torch.Tensor,
    *,
    canary: torch.Tensor | None = None,
    null_rows: torch.Tensor | None = None,
    top_k: int = 1,
):
    """int64 [R_cap] addresses of ``buffer`` rows (row = route index // ``top_k``) for live
    rows; padding and idle rows point at rows of ``canary`` (kernels must never use those
    entries) or are 0 (the routing layer's padding value). ``null_rows`` (bool [R_cap])
    zeroes live entries."""
    row_bytes = buffer.shape[-1] * buffer.element_size()
    route = layout.route_of_row
    table = torch.where(route >= 0,
                        buffer.data_ptr() + route.clamp(min=0) // top_k * row_bytes, 0)
    if canary is not None:
        other = (route < 0).nonzero().reshape(-1)
        target_rows = torch.arange(other.numel()) % canary.shape[0]
        table[other] = canary.data_ptr() + target_rows * row_bytes
    if null_rows is not None:
        table[null_rows] = 0
    return table.to(DEVICE)


def act_rows(layout: Layout, source: torch.Tensor, *, top_k: int = 1, spare=float("nan")):
    """[R_act, width] activation rows ``source[route // top_k]`` (``top_k`` = K: the route's
    token), ``spare`` in the rows past the live end."""
    route = layout.route_of_act.to(DEVICE)
    out = source[route.clamp(min=0) // top_k].clone()
    out[route < 0] = spare
    return out


# --------------------------------------------------------------------------------------------
# route_grads / reduce_routes
# --------------------------------------------------------------------------------------------


def _route_problem(num_tokens, t_max, top_k, hidden):
    ids = make_ids(num_tokens, top_k, [0, 1, 2, 3]).to(torch.int16).to(DEVICE)  # int16 ids
    active = ids.long().reshape(-1) >= 0
    scores = torch.rand(num_tokens, top_k, device=DEVICE) * (ids >= 0)
    grad_y = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    h3 = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    h3[: num_tokens * top_k][~active] = float("nan")  # inactive routes: never read
    return ids, active, scores, grad_y, h3


@pytest.mark.parametrize(
    "hidden,block_d,top_k",
    [
        (40, 16, 3),  # D tail in the last step
        (64, 64, 1),  # one step; K = 1
    ],
)
def test_route_grads(hidden, block_d, top_k):
    num_tokens, t_max = 7, 9  # odd T; buffers sized for T_max > T
    ids, active, scores, grad_y, h3 = _route_problem(num_tokens, t_max, top_k, hidden)
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


@pytest.mark.parametrize(
    "mode",
    [
        "addr",  # h3 rows at a device-side address inside a larger buffer
        "addr_in_place",  # h3_addr names the rows of grad_routes_out (combine buffer)
        "tensor_in_place",  # h3_routes is grad_routes_out
    ],
)
def test_route_grads_h3_addr(mode):
    num_tokens, t_max, top_k, hidden = 7, 9, 3, 40
    ids, active, scores, grad_y, h3 = _route_problem(num_tokens, t_max, top_k, hidden)
    config = RouteGradConfig(block_rows=4, block_d=16, num_warps=4)  # 3 column steps, D tail
    # The plain path (separate tensors) is the reference: same kernel arithmetic, bit-exact.
    plain_routes = poisoned(t_max * top_k, hidden)
    plain_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    route_grads(grad_y, h3, ids, scores, plain_routes, plain_scores, config=config)

    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    if mode == "addr":
        lead = 5  # route row 0 sits 5 rows into the buffer (a non-zero, 16-byte aligned offset)
        buffer = torch.randn(lead + t_max * top_k + 2, hidden, device=DEVICE).bfloat16()
        buffer[lead : lead + t_max * top_k] = h3
        buffer_before = buffer.clone()
        addr = torch.tensor([buffer[lead].data_ptr()], dtype=torch.int64, device=DEVICE)
        grad_routes = poisoned(t_max * top_k, hidden)
        route_grads(
            grad_y, None, ids, scores, grad_routes, grad_scores, h3_addr=addr, config=config
        )
        assert same_bits(buffer, buffer_before)  # h3 rows: read only
        assert same_bits(grad_routes, plain_routes)  # inactive and spare rows still poison
    else:
        grad_routes = h3.clone()  # the combine buffer holds the routes' results
        if mode == "addr_in_place":
            addr = torch.tensor([grad_routes.data_ptr()], dtype=torch.int64, device=DEVICE)
            route_grads(
                grad_y, None, ids, scores, grad_routes, grad_scores, h3_addr=addr, config=config
            )
        else:
            route_grads(grad_y, grad_routes, ids, scores, grad_routes, grad_scores, config=config)
        n = num_tokens * top_k
        expected = h3.clone()  # inactive routes and rows past T*K keep the h3 values
        expected[:n][active] = plain_routes[:n][active]
        assert same_bits(grad_routes, expected)
    assert same_bits(grad_scores, plain_scores)



PUSH_ROWS = 12  # destination rows per rank: room to spare, unused rows keep their poison


def _push_destinations(ids, active, hidden):
    """Two ranks (experts 0-1 on rank 0, 2-3 on rank 1): each active route's destination
    rank, its row there (a random permutation of each rank's rows; one active route that its
    rank does not execute gets -1), both ranks' poisoned row buffers and their addresses.
    Returns (dest_rank [T*K], dest_rows int32 [T, K] on DEVICE, bufs, bases)."""
    num_tokens, top_k = ids.shape
    dest_rank = torch.where(active, ids.long().reshape(-1) // 2, -1)
    dest_rows = torch.full((num_tokens * top_k,), -1, dtype=torch.int32)
    for r in (0, 1):
        mine = (dest_rank == r).nonzero().flatten()
        dest_rows[mine] = torch.randperm(PUSH_ROWS)[: mine.numel()].int()
    dest_rows[active.nonzero().flatten()[:1]] = -1
    bufs = [poisoned(PUSH_ROWS, hidden) for _ in range(2)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEVICE)
    return dest_rank, dest_rows.to(DEVICE).reshape(num_tokens, top_k), bufs, bases


def _assert_pushed(bufs, dest_rank, dest_rows, row_of_route):
    """Each rank's buffer holds ``row_of_route(route)`` at every pushed route's row, bit for
    bit, and its poison everywhere else."""
    flat_rows = dest_rows.reshape(-1).cpu()
    for r, buf in enumerate(bufs):
        expected = poisoned(PUSH_ROWS, buf.shape[1])
        for route in ((dest_rank == r) & (flat_rows >= 0)).nonzero().flatten().tolist():
            expected[flat_rows[route]] = row_of_route(route)
        assert same_bits(buf, expected)


@pytest.mark.parametrize("h3_addr", [False, True], ids=["h3_tensor", "h3_addr"])
def test_route_grads_push(h3_addr):
    """Push mode: each active route's row lands at its destination rank's row (two ranks'
    buffers here, experts 0-1 on rank 0 and 2-3 on rank 1, rows a random permutation);
    bit-exact against the plain path, and nothing else of either buffer is written."""
    num_tokens, t_max, top_k, hidden = 7, 9, 3, 40
    ids, active, scores, grad_y, h3 = _route_problem(num_tokens, t_max, top_k, hidden)
    config = RouteGradConfig(block_rows=4, block_d=16, num_warps=4)
    plain_routes = poisoned(t_max * top_k, hidden)
    plain_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    route_grads(grad_y, h3, ids, scores, plain_routes, plain_scores, config=config)

    dest_rank, dest_rows, bufs, bases = _push_destinations(ids, active, hidden)
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    h3_before = h3.clone()
    if h3_addr:
        addr = torch.tensor([h3.data_ptr()], dtype=torch.int64, device=DEVICE)
        route_grads(grad_y, None, ids, scores, None, grad_scores, h3_addr=addr,
                    dest_rows=dest_rows, dest_bases=bases, experts_per_rank=2, config=config)
    else:
        route_grads(grad_y, h3, ids, scores, None, grad_scores, dest_rows=dest_rows,
                    dest_bases=bases, experts_per_rank=2, config=config)
    assert same_bits(grad_scores, plain_scores)
    assert same_bits(h3, h3_before)
    _assert_pushed(bufs, dest_rank, dest_rows, lambda route: plain_routes[route])

    # push mode takes no grad_routes_out, and all three push arguments
    with pytest.raises(ValueError, match="grad_routes_out must be None in push mode"):
        route_grads(grad_y, h3, ids, scores, plain_routes, grad_scores, dest_rows=dest_rows,
                    dest_bases=bases, experts_per_rank=2)
    with pytest.raises(ValueError, match=r"experts_per_rank \(None\) must be an int >= 1"):
        route_grads(grad_y, h3, ids, scores, None, grad_scores, dest_rows=dest_rows,
                    dest_bases=bases)
    with pytest.raises(TypeError, match="dest_rows"):
        route_grads(grad_y, h3, ids, scores, None, grad_scores, dest_rows=dest_rows.long(),
                    dest_bases=bases, experts_per_rank=2)
    with pytest.raises(TypeError, match="grad_routes_out must be a torch.Tensor unless"):
        route_grads(grad_y, h3, ids, scores, None, grad_scores)

def test_push_route_grads():
    """Every executed route's destination row receives grad_y[t] bit for bit (unscaled);
    every active route's score lands as the fp32 at the start of its own route row; nothing
    else of either rank's rows or the route rows is written."""
    num_tokens, t_max, top_k, hidden = 7, 9, 3, 40
    ids, active, scores, grad_y, _ = _route_problem(num_tokens, t_max, top_k, hidden)
    dest_rank, dest_rows, bufs, bases = _push_destinations(ids, active, hidden)
    route_rows = poisoned(t_max * top_k, hidden)
    config = RouteGradConfig(block_rows=4, block_d=16, num_warps=4)  # 3 column steps, D tail
    push_route_grads(grad_y, ids, scores, route_rows, dest_rows=dest_rows, dest_bases=bases,
                     experts_per_rank=2, config=config)

    _assert_pushed(bufs, dest_rank, dest_rows, lambda route: grad_y[route // top_k])
    expected = poisoned(t_max * top_k, hidden).view(torch.float32)
    n = num_tokens * top_k
    expected[:n][active, 0] = scores.reshape(-1)[active]
    assert same_bits(route_rows.view(torch.float32), expected)

    with pytest.raises(ValueError, match=r"score_rows must have shape \[R, 40\] with R >= "):
        push_route_grads(grad_y, ids, scores, route_rows[:n - 1], dest_rows=dest_rows,
                         dest_bases=bases, experts_per_rank=2)
    with pytest.raises(ValueError, match=r"experts_per_rank \(0\) must be an int >= 1"):
        push_route_grads(grad_y, ids, scores, route_rows, dest_rows=dest_rows,
                         dest_bases=bases, experts_per_rank=0)
    with pytest.raises(TypeError, match="scores must have dtype"):
        push_route_grads(grad_y, ids, scores.double(), route_rows, dest_rows=dest_rows,
                         dest_bases=bases, experts_per_rank=2)


def test_reduce_routes_score_parts():
    """With score_rows: grad_scores is the fp32 sum of each active route's parts (values
    1..P of its row, value 0 being the score), 0 for inactive routes; grad_x unchanged."""
    num_tokens, top_k, t_max, hidden, parts = 9, 4, 10, 48, 5
    ids = make_ids(num_tokens, top_k, [0, 1, 2, 3, 4]).to(DEVICE)
    active = ids.reshape(-1) >= 0
    rows = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    rows[: num_tokens * top_k][~active] = float("nan")
    route_rows = poisoned(t_max * top_k, hidden)  # values past 1 + P: never read
    values = route_rows.view(torch.float32)
    values[:, : 1 + parts] = torch.randn(t_max * top_k, 1 + parts, device=DEVICE)
    values[: num_tokens * top_k][~active] = float("nan")  # inactive: never read
    route_rows_before = route_rows.clone()
    grad_x, plain_x = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    config = RouteGradConfig(block_rows=4, block_d=32)
    reduce_routes(rows, ids, plain_x, config=config)
    reduce_routes(rows, ids, grad_x, score_rows=route_rows, score_parts=parts,
                  grad_scores_out=grad_scores, config=config)
    assert same_bits(grad_x, plain_x) and same_bits(route_rows, route_rows_before)
    want = values[: num_tokens * top_k, 1 : 1 + parts].double().sum(dim=1)
    want = torch.where(active, want, 0.0).reshape(num_tokens, top_k)
    # fp32 sum of 5 values in a tree order: within 5 * 2^-24 of the exact sum, relative to
    # the sum of magnitudes
    mag = values[: num_tokens * top_k, 1 : 1 + parts].double().abs().sum(dim=1)
    mag = torch.where(active, mag, 0.0).reshape(num_tokens, top_k)
    assert ((grad_scores.double() - want).abs() <= 5 * 2.0**-24 * mag).all()
    assert (grad_scores.reshape(-1)[~active] == 0).all()

    with pytest.raises(ValueError, match=r"score_parts \(24\) must be an int in \[1, D/2 - 1"):
        reduce_routes(rows, ids, grad_x, score_rows=route_rows, score_parts=24,
                      grad_scores_out=grad_scores)
    with pytest.raises(TypeError, match="grad_scores_out must be a torch.Tensor"):
        reduce_routes(rows, ids, grad_x, score_rows=route_rows, score_parts=parts)


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
    """Expert 3 gets no routes (no segment); expert 1 gets a whole extra tile of padding rows;
    one live row has a null table entry; h1 rows that must not be read are NaN."""
    num_experts, num_tokens, top_k, t_max = 4, 11, 3, 12
    experts = [2] if one_expert else [0, 1, 2]
    ids = make_ids(num_tokens, top_k, experts)
    layout = build_layout(ids, num_experts, block_m, extra_tiles={1: 1})
    combine = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    route = layout.route_of_row.to(DEVICE)
    unrouted = torch.ones(combine.shape[0], dtype=torch.bool, device=DEVICE)
    unrouted[route[route >= 0]] = False
    combine[unrouted] = float("nan")  # rows no live table entry names: never read
    null_rows = torch.zeros(layout.num_rows, dtype=torch.bool)
    null_rows[layout.is_live.nonzero()[1]] = True  # one live row with a null address
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    h1 = torch.randn(layout.num_act, 2 * ffn, device=DEVICE).bfloat16() * 2
    h1[~layout.live_act()] = float("nan")  # spare rows past the live end: never read
    h1[layout.act_of_row[null_rows].to(DEVICE)] = float("nan")  # null rows: never read
    # Padding and idle entries point at a (NaN) row of combine that no live entry names.
    canary = unrouted.nonzero()[0].item()
    ptrs = row_table(layout, combine, canary=combine[canary : canary + 1], null_rows=null_rows)
    return layout, combine, w2, h1, ptrs, null_rows


@pytest.mark.parametrize(
    "mode",
    [
        "gather_once",  # grad_h3_out given: row gather launch, then TMA-fed GEMM
        "gather_in_loop",  # no grad_h3_out: pointer gather inside the K loop
        "in_place",  # grad_h1_out is h1
        "one_expert",  # every route to one expert
        "grad_h1_only",  # neither h2_out nor grad_h3_out
        "narrow_tiles",  # block_n 16: the epilogue without column halves
        "wide",  # block_n 256: the epilogue in four column parts (F = 200: the last masked)
        "device_descriptors",  # TMA descriptors built in the kernel, not on the host
    ],
)
def test_w2_dgrad_swiglu_bwd(mode):
    hidden, block_m = 48, 16  # D and F not multiples of the tiles: masked tails
    ffn = 200 if mode == "wide" else 40
    layout, combine, w2, h1, ptrs, null_rows = _w2_problem(
        hidden, ffn, block_m, one_expert=mode == "one_expert"
    )
    num_act = layout.num_act
    h1_saved = h1.clone()
    grad_h1 = h1 if mode == "in_place" else poisoned(num_act, 2 * ffn)
    h2 = None if mode == "grad_h1_only" else poisoned(num_act, ffn)
    grad_h3 = None if mode in ("gather_in_loop", "grad_h1_only") else poisoned(num_act, hidden)
    block_n = {"narrow_tiles": 16, "wide": 256}.get(mode, 32)
    config = W2DgradConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=min(block_n, 32),
        num_warps=4,
        group_m=2,
        host_descriptors=mode != "device_descriptors",
    )

    w2_dgrad_swiglu_bwd(
        ptrs,
        layout.padded_offsets,
        layout.row_offsets,
        w2,
        h1,
        grad_h1,
        h2_out=h2,
        grad_h3_out=grad_h3,
        config=config,
    )

    ref_grad_h1, ref_h2, ref_grad_h3 = w2_dgrad_swiglu_bwd_ref(
        ptrs, layout.padded_offsets, layout.row_offsets, w2, h1_saved, row_sources=[combine]
    )
    live = layout.live_act()
    spare = ~live
    num_spare = int(spare.sum())
    assert num_spare > 0
    # grad_h1 and h2: an fp32 GEMM plus fp32 SwiGLU terms, rounded to bf16 once.
    assert_bf16_close(grad_h1[live], ref_grad_h1[live])
    if mode == "in_place":
        assert same_bits(grad_h1[spare], h1_saved[spare])
    else:
        assert same_bits(grad_h1[spare], poisoned(num_spare, 2 * ffn))
    null = layout.act_of_row[null_rows].to(DEVICE)
    assert (grad_h1[null] == 0).all()
    if h2 is not None:
        assert_bf16_close(h2[live], ref_h2[live])
        assert (h2[null] == 0).all()
        assert same_bits(h2[spare], poisoned(num_spare, ffn))
    if grad_h3 is not None:  # data movement: bit-exact, zeros for null rows
        assert same_bits(grad_h3[live], ref_grad_h3[live].bfloat16())
        assert same_bits(grad_h3[spare], poisoned(num_spare, hidden))


def _run_w2_dgrad(layout, ptrs, w2, h1_arg, grad_h1_out, config, *, gather_once,
                  h1_offset=None):
    """One w2_dgrad_swiglu_bwd into NaN-poisoned h2 (and grad_h3 when gathering once);
    returns (grad_h1_out, h2, grad_h3)."""
    num_act, ffn = layout.num_act, w2.shape[2]
    h2 = poisoned(num_act, ffn)
    grad_h3 = poisoned(num_act, w2.shape[1]) if gather_once else None
    w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1_arg,
                        grad_h1_out, h1_offset=h1_offset, h2_out=h2, grad_h3_out=grad_h3,
                        config=config)
    return grad_h1_out, h2, grad_h3


@pytest.mark.parametrize("gather_once", [True, False])
def test_w2_dgrad_h1_offset(gather_once):
    """h1 at a device-side offset into a 1-D base, out of place and in place (grad_h1_out
    over the very h1 rows): bit-exact equal to the plain 2-D path (same kernel arithmetic)."""
    hidden, ffn, block_m = 48, 40, 16
    # combine must outlive the launches: ptrs point into it.
    layout, combine, w2, h1, ptrs, _ = _w2_problem(hidden, ffn, block_m)
    num_act = layout.num_act
    config = W2DgradConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4, group_m=2)
    outs = {}

    def run(name, h1_arg, grad_h1_out, h1_offset=None):
        grad_h1_out, h2, grad_h3 = _run_w2_dgrad(
            layout, ptrs, w2, h1_arg, grad_h1_out, config, gather_once=gather_once,
            h1_offset=h1_offset)
        outs[name] = (grad_h1_out.clone(), h2, grad_h3)

    run("plain", h1, poisoned(num_act, 2 * ffn))
    offset = 8 * 7  # elements: 16-byte aligned, not a multiple of a row (2F = 80)
    base = torch.randn(offset + num_act * 2 * ffn + 24, device=DEVICE).bfloat16()
    base[offset : offset + num_act * 2 * ffn] = h1.reshape(-1)
    base_before = base.clone()
    h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    run("offset", base, poisoned(num_act, 2 * ffn), h1_offset)
    assert same_bits(base, base_before)  # out of place: the base is only read
    rows_view = base[offset : offset + num_act * 2 * ffn].view(num_act, 2 * ffn)
    run("in_place", base, rows_view, h1_offset)

    live = layout.live_act()
    for name in ("offset", "in_place"):
        for got, want in zip(outs[name][1:], outs["plain"][1:], strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert same_bits(got, want)
    assert same_bits(outs["offset"][0], outs["plain"][0])
    assert same_bits(outs["in_place"][0][live], outs["plain"][0][live])
    # In place: the base outside the live rows keeps its bits (spare rows, lead, tail).
    expected = base_before.clone()
    expected[offset : offset + layout.live_end * 2 * ffn] = outs["plain"][0][live].reshape(-1)
    assert same_bits(base, expected)



@pytest.mark.parametrize("persistent", [False, True])
def test_w2_dgrad_pre_gathered_rows(persistent):
    """grad_h3_rows (rows pushed there by their owners): nothing is gathered or written
    there, and every output is bit-exact equal to the gather-once path's."""
    hidden, ffn, block_m = 48, 40, 16
    layout, combine, w2, h1, ptrs, _ = _w2_problem(hidden, ffn, block_m)
    num_act = layout.num_act
    config = W2DgradConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4, group_m=2,
                           persistent=persistent)
    grad_h1, h2, grad_h3 = _run_w2_dgrad(layout, ptrs, w2, h1, poisoned(num_act, 2 * ffn),
                                         config, gather_once=True)
    rows = grad_h3.clone()
    live = layout.live_act()
    rows[~live] = 0.0  # the rows a push never writes: zeros (NaN would reach no output either)
    rows_before = rows.clone()
    got_h1, got_h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
    w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, got_h1,
                        h2_out=got_h2, grad_h3_rows=rows, config=config)
    assert same_bits(rows, rows_before)  # read only
    assert same_bits(got_h1, grad_h1) and same_bits(got_h2, h2)
    # gluon=True where the Gluon kernel cannot run (the interpreter, 16-row tiles): a warning
    # that says why, then the Triton kernel, the same bits
    gluon_cfg = replace(config, gluon=True)
    for kwargs in (dict(grad_h3_rows=rows), dict(grad_h3_out=poisoned(num_act, hidden))):
        w_h1, w_h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        with pytest.warns(RuntimeWarning, match=r"w2_dgrad_swiglu_bwd: config\.gluon is set, "
                                                r"but the Gluon kernel cannot run this call"):
            w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, w_h1,
                                h2_out=w_h2, config=gluon_cfg, **kwargs)
        assert same_bits(w_h1, grad_h1) and same_bits(w_h2, h2)
    with pytest.raises(ValueError, match="grad_h3_out and grad_h3_rows exclude each other"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, got_h1,
                            grad_h3_out=poisoned(num_act, hidden), grad_h3_rows=rows)
    with pytest.raises(ValueError, match="grad_h3_rows"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, got_h1,
                            grad_h3_rows=rows[:-1])

def _scored_problem(hidden, ffn, block_m):
    """The W2 DGRAD problem of :func:`_w2_problem` in the layer's scored form: unscaled
    grad_h3 rows pre-gathered in activation rows (spare rows NaN, the null row zeros), each
    route's fp32 score at the start of its (otherwise poisoned) route row, which the table
    points at. Returns (layout, w2, h1, ptrs, route_rows, rows, row_scores, ref_ptrs,
    g_routes)."""
    layout, _, w2, h1, _, null_rows = _w2_problem(hidden, ffn, block_m)
    n_routes = 12 * 3  # t_max * top_k of _w2_problem
    g_routes = torch.randn(n_routes, hidden, device=DEVICE).bfloat16()
    scores = torch.rand(n_routes, device=DEVICE) + 0.25
    route_rows = poisoned(n_routes, hidden)
    route_rows.view(torch.float32)[:, 0] = scores
    canary = poisoned(1, hidden)  # padding and idle entries: never used
    ptrs = row_table(layout, route_rows, canary=canary, null_rows=null_rows)
    ref_ptrs = row_table(layout, g_routes, null_rows=null_rows)
    rows = act_rows(layout, g_routes)  # route_of_act indexes g_routes (top_k=1)
    null_act = layout.act_of_row[null_rows].to(DEVICE)
    rows[null_act] = 0.0
    route = layout.route_of_act.to(DEVICE)
    row_scores = torch.where(route >= 0, scores[route.clamp(min=0)], 0.0)
    return layout, w2, h1, ptrs, route_rows, rows, row_scores, ref_ptrs, g_routes, null_act, canary


@pytest.mark.parametrize("block_n,persistent", [(32, False), (32, True), (256, False), (16, False)],
                         ids=["halves", "halves_persistent", "eighths", "one_part"])
def test_w2_dgrad_scored_rows(block_n, persistent):
    """scored_rows: grad_h1 and h2 are the SwiGLU backward of score * (g @ W2) and score * h2;
    each live non-null route row receives one fp32 part per column tile after its score; the
    score, the rest of the route rows, spare rows and the canary keep their bits."""
    hidden, block_m = 48, 16
    ffn = 200 if block_n == 256 else 40  # masked tails in the last column tile
    (layout, w2, h1, ptrs, route_rows, rows, row_scores, ref_ptrs, g_routes, null_act,
     canary) = _scored_problem(hidden, ffn, block_m)
    num_act, num_parts = layout.num_act, -(-ffn // block_n)
    config = W2DgradConfig(block_m=block_m, block_n=block_n, block_k=min(block_n, 32),
                           num_warps=4, group_m=2, persistent=persistent)
    before = route_rows.clone()
    rows_before, canary_before = rows.clone(), canary.clone()
    grad_h1, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
    w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                        h2_out=h2, grad_h3_rows=rows, scored_rows=True, config=config)

    ref_h1, ref_h2, _, ref_parts = w2_dgrad_swiglu_bwd_ref(
        ref_ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, row_sources=[g_routes],
        row_scores=row_scores, block_n=block_n)
    live = layout.live_act()
    assert_bf16_close(grad_h1[live], ref_h1[live])
    assert_bf16_close(h2[live], ref_h2[live])
    assert (grad_h1[null_act] == 0).all() and (h2[null_act] == 0).all()
    assert same_bits(grad_h1[~live], poisoned(int((~live).sum()), 2 * ffn))
    assert same_bits(rows, rows_before) and same_bits(canary, canary_before)
    # parts: fp32 sums of up to block_n products of the fp32 GEMM result with bf16(h2); the
    # kernel's and torch's sigmoid may round h2 to neighbouring bf16 values: 2^-8 of the
    # largest part bounds that, far below what a wrong row, column or scale gives
    values = route_rows.view(torch.float32)
    expected = before.view(torch.float32).clone()
    route = layout.route_of_act.to(DEVICE)
    has_part = live.clone()
    has_part[null_act] = False
    got = values[route[has_part]][:, 1 : 1 + num_parts]
    want = ref_parts[has_part]
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    assert ((got - want).abs() <= 2.0**-8 * scale).all(), (got - want).abs().max().item()
    expected[route[has_part], 1 : 1 + num_parts] = got
    assert same_bits(values, expected)  # scores and everything past the parts: untouched

    with pytest.raises(ValueError, match="scored_rows needs grad_h3_rows"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                            grad_h3_out=poisoned(num_act, hidden), scored_rows=True)
    with pytest.raises(TypeError, match="scored_rows must be a bool, got int"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                            grad_h3_rows=rows, scored_rows=1)


def assert_walks_several_tiles(config, num_tiles_cap, live_tiles):
    """Under the interpreter a persistent grid has fewer programs than live tiles, so programs
    walk several tiles (on a GPU the grid is one program per SM)."""
    programs = gemm_grid(config, num_tiles_cap, DEVICE)
    if INTERPRETED:
        assert programs < live_tiles, (programs, live_tiles)


@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
@pytest.mark.parametrize("gather_once", [True, False], ids=["gather_once", "gather_in_loop"])
def test_w2_dgrad_persistent(gather_once, host_descriptors):
    """persistent=True is bit-identical to one program per tile (every tile is computed the
    same way; only the order and the program differ): plain h1, and h1 at a device-side offset
    in place (the offset is read once per persistent program). Poison outside the live rows
    stays, the padding tile, the empty expert and the idle tiles are skipped."""
    hidden, ffn, block_m, block_n = 48, 40, 16, 32
    layout, combine, w2, h1, ptrs, null_rows = _w2_problem(hidden, ffn, block_m)
    num_act = layout.num_act
    h1_saved = h1.clone()
    live_tiles = int(layout.padded_offsets[-1]) // block_m * math.ceil(ffn / block_n)
    configs = {
        persistent: W2DgradConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=4,
                                  group_m=2, persistent=persistent,
                                  host_descriptors=host_descriptors)
        for persistent in (False, True)
    }
    assert_walks_several_tiles(
        configs[True], layout.num_rows // block_m * math.ceil(ffn / block_n), live_tiles
    )

    def run(persistent, h1_arg, grad_h1_out, h1_offset=None):
        return _run_w2_dgrad(layout, ptrs, w2, h1_arg, grad_h1_out, configs[persistent],
                             gather_once=gather_once, h1_offset=h1_offset)

    tiles = run(False, h1, poisoned(num_act, 2 * ffn))
    walked = run(True, h1, poisoned(num_act, 2 * ffn))
    for got, want in zip(walked, tiles, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert same_bits(got, want)  # poisoned spare rows included
    assert same_bits(h1, h1_saved)  # out of place: h1 is only read

    # The persistent outputs themselves: against the reference, poison kept past the live end.
    ref_grad_h1, ref_h2, ref_grad_h3 = w2_dgrad_swiglu_bwd_ref(
        ptrs, layout.padded_offsets, layout.row_offsets, w2, h1_saved, row_sources=[combine]
    )
    live, spare = layout.live_act(), ~layout.live_act()
    num_spare = int(spare.sum())
    grad_h1, h2, grad_h3 = walked
    assert_bf16_close(grad_h1[live], ref_grad_h1[live])
    assert_bf16_close(h2[live], ref_h2[live])
    assert same_bits(grad_h1[spare], poisoned(num_spare, 2 * ffn))
    assert same_bits(h2[spare], poisoned(num_spare, ffn))
    assert (grad_h1[layout.act_of_row[null_rows].to(DEVICE)] == 0).all()
    if gather_once:
        assert same_bits(grad_h3[live], ref_grad_h3[live].bfloat16())
        assert same_bits(grad_h3[spare], poisoned(num_spare, hidden))

    # h1 at a device-side offset, grad_h1 in place over those rows.
    offset = 8 * 7  # elements: 16-byte aligned, not a multiple of a row (2F = 80)
    base = torch.randn(offset + num_act * 2 * ffn + 24, device=DEVICE).bfloat16()
    base[offset : offset + num_act * 2 * ffn] = h1_saved.reshape(-1)
    base_before = base.clone()
    rows_view = base[offset : offset + num_act * 2 * ffn].view(num_act, 2 * ffn)
    h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    _, h2_in_place, grad_h3_in_place = run(True, base, rows_view, h1_offset)
    assert same_bits(h2_in_place, tiles[1])
    if gather_once:
        assert same_bits(grad_h3_in_place, tiles[2])
    expected = base_before.clone()
    expected[offset : offset + layout.live_end * 2 * ffn] = tiles[0][live].reshape(-1)
    assert same_bits(base, expected)  # live rows: the gradients; all else keeps its bits


# --------------------------------------------------------------------------------------------
# W13 DGRAD + scatter
# --------------------------------------------------------------------------------------------


def _w13_problem(num_experts, hidden, ffn, block_m, experts):
    """Experts not in ``experts`` get no rows; experts 0 and 2 an extra tile of padding rows
    (expert 2 with no routes: a padding tile only). Spare grad_h1 rows past the live end are
    NaN (read by the last tile's padding rows, never stored)."""
    num_tokens, top_k = 11, 3
    ids = make_ids(num_tokens, top_k, experts)
    layout = build_layout(ids, num_experts, block_m, extra_tiles={0: 1, 2: 1})
    return (layout, *_w13_operands(layout, num_experts, hidden, ffn))


def _w13_operands(layout, num_experts, hidden, ffn):
    """Random ``w13`` and ``grad_h1`` for ``layout``; grad_h1's spare rows past the live end
    are NaN."""
    w13 = (torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    grad_h1 = torch.randn(layout.num_act, 2 * ffn, device=DEVICE).bfloat16()
    grad_h1[~layout.live_act()] = float("nan")
    return w13, grad_h1


def _w13_targets(layout, hidden, *, t_max=12, top_k=3):
    """A dispatch buffer (route rows) and canary rows for the padding and idle entries (both
    random: rows that must stay untouched), and the pointer table into them."""
    dispatch = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    canary = torch.randn(3, hidden, device=DEVICE).bfloat16()
    return dispatch, canary, row_table(layout, dispatch, canary=canary)


def _check_w13_scatter(layout, dispatch, dispatch_before, canary, canary_before, ref, *,
                       stored=None):
    """Live routes (or the padded rows ``stored``, bool [R_cap]) hold the reference rounded
    once; every other dispatch row and the canaries keep their bits."""
    is_route = (layout.is_live if stored is None else stored).to(DEVICE)
    targets = layout.route_of_row.to(DEVICE)[is_route]
    # One fp32 GEMM rounded to bf16.
    assert_bf16_close(dispatch[targets], ref[is_route])
    untouched = torch.ones(dispatch.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[targets] = False  # inactive routes and rows beyond T*K: not written
    assert untouched.any()
    assert same_bits(dispatch[untouched], dispatch_before[untouched])
    assert same_bits(canary, canary_before)


@pytest.mark.parametrize(
    "one_expert,host_descriptors",
    [
        (False, True),
        (True, True),  # every route to one expert
        (False, False),  # TMA descriptors built in the kernel
    ],
)
def test_w13_dgrad_scatter(one_expert, host_descriptors):
    num_experts, hidden, ffn, block_m = 5, 40, 24, 16  # prime E; 2F = 48: a K tail with
    # block_k 32; D tail too. Experts 2 and 3 get no rows.
    layout, w13, grad_h1 = _w13_problem(
        num_experts, hidden, ffn, block_m, [1] if one_expert else [0, 1, 4]
    )
    dispatch, canary, ptrs = _w13_targets(layout, hidden)
    dispatch_before, canary_before = dispatch.clone(), canary.clone()

    config = W13DgradConfig(
        block_m=block_m, block_n=32, block_k=32, num_warps=4, host_descriptors=host_descriptors
    )
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs, config=config)

    ref = w13_dgrad_scatter_ref(
        grad_h1, layout.padded_offsets, layout.row_offsets, w13, num_rows=layout.num_rows
    )
    _check_w13_scatter(layout, dispatch, dispatch_before, canary, canary_before, ref)


@pytest.mark.parametrize("dynamic", [False, True], ids=["strided", "dynamic"])
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
def test_w13_dgrad_persistent(host_descriptors, dynamic):
    """persistent=True is bit-identical to one program per tile (same tiles, computed the same
    way): every destination row, the untouched ones and the canaries included; with
    ``dynamic`` the programs take their tiles from a counter."""
    num_experts, hidden, ffn, block_m, block_n = 5, 40, 24, 16, 32
    layout, w13, grad_h1 = _w13_problem(num_experts, hidden, ffn, block_m, [0, 1, 4])
    live_tiles = int(layout.padded_offsets[-1]) // block_m * math.ceil(hidden / block_n)
    results = {}
    for persistent in (False, True):
        torch.manual_seed(1)  # the same destination contents for both grids
        dispatch, canary, ptrs = _w13_targets(layout, hidden)
        dispatch_before, canary_before = dispatch.clone(), canary.clone()
        config = W13DgradConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=4,
                                persistent=persistent, host_descriptors=host_descriptors,
                                dynamic=dynamic and persistent)
        if persistent:
            assert_walks_several_tiles(
                config, layout.num_rows // block_m * math.ceil(hidden / block_n), live_tiles
            )
        w13_dgrad_scatter(
            grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs, config=config
        )
        results[persistent] = (dispatch, dispatch_before, canary, canary_before)
    assert same_bits(results[True][0], results[False][0])
    assert same_bits(results[True][1], results[False][1])  # same contents before the runs
    ref = w13_dgrad_scatter_ref(
        grad_h1, layout.padded_offsets, layout.row_offsets, w13, num_rows=layout.num_rows
    )
    _check_w13_scatter(layout, *results[True], ref)


def _w13_dgrad_pair_tails_case(counts, hidden, ffn, config, *, null_rows=(), launch=None):
    """W13 DGRAD with ``counts`` live rows per expert (experts 0 and 2 get an extra padding
    tile) against the reference: every live route holds it; nothing else (other dispatch
    rows, the canaries behind padding and idle entries) is written. ``null_rows``: padded
    rows whose (live) entry is 0, their routes not written. ``launch(grad_h1, po, ro, w13,
    ptrs)`` runs the kernel (default: ``w13_dgrad_scatter`` with ``config``). Returns the
    routes' rows, for comparing configs."""
    torch.manual_seed(11)
    routes, start = [], 0
    for c in counts:
        routes.append(torch.randperm(c) + start)
        start += c
    layout = layout_from_routes(routes, config.block_m, extra_tiles={0: 1, 2: 1})
    w13, grad_h1 = _w13_operands(layout, len(counts), hidden, ffn)
    dispatch, canary, ptrs = _w13_targets(layout, hidden, t_max=start + 4, top_k=1)
    null = torch.zeros(layout.num_rows, dtype=torch.bool)
    null[list(null_rows)] = True
    assert layout.is_live[null].all(), "null_rows must be live rows"
    ptrs[null.to(DEVICE)] = 0
    dispatch_before, canary_before = dispatch.clone(), canary.clone()
    if launch is None:
        w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                          config=config)
    else:
        launch(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs)
    ref = w13_dgrad_scatter_ref(
        grad_h1, layout.padded_offsets, layout.row_offsets, w13, num_rows=layout.num_rows
    )
    _check_w13_scatter(layout, dispatch, dispatch_before, canary, canary_before, ref,
                       stored=layout.is_live & ~null)
    return dispatch


# block_m 32: tails of 1 and of 16 (exactly half) after a whole tile (pairs), an empty
# expert, whole tiles only, a last tile of 17 (no pair), a one-tile expert of 1 row (no
# pair), a tail of 5 after two whole tiles (the last two a pair), whole tiles, a one-tile
# expert of 17 rows
PAIR_COUNTS = [33, 48, 0, 64, 49, 1, 69, 96, 17]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "tile_grid"])
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
def test_w13_dgrad_pair_tails(host_descriptors, persistent):
    """pair_tails: an expert's last tile with at most block_m / 2 live rows is computed
    with the tile before it (two halves of block_n / 2 columns over both)."""
    config = W13DgradConfig(block_m=32, block_n=32, block_k=32, num_warps=4,
                            persistent=persistent, host_descriptors=host_descriptors,
                            pair_tails=True)
    # D = 40: a column tail (the halves are 16 wide: the second half of the last column tile
    # is past D); 2F = 48: a K tail
    _w13_dgrad_pair_tails_case(PAIR_COUNTS, 40, 24, config)


def test_w13_dgrad_dynamic_rules():
    with pytest.raises(ValueError, match="dynamic=True needs persistent=True"):
        W13DgradConfig(dynamic=True)
    with pytest.raises(TypeError, match="dynamic must be a bool"):
        W13DgradConfig(persistent=True, dynamic=1)
    # moving a config to the tile grid drops the hand-out; back keeps it off
    handed = W13DgradConfig(persistent=True, dynamic=True, pair_tails=True)
    assert handed.with_grid(False) == W13DgradConfig(pair_tails=True)
    assert handed.with_grid(True) == handed
    assert handed.with_grid(False).with_grid(True) == replace(handed, dynamic=False)
    assert W2DgradConfig().with_grid(True) == W2DgradConfig(persistent=True)


def test_w13_dgrad_pair_tails_rules():
    with pytest.raises(ValueError, match="pair_tails=True needs block_n >= 32, got block_n=16"):
        W13DgradConfig(block_n=16, pair_tails=True)
    with pytest.raises(TypeError, match="pair_tails must be a bool"):
        W13DgradConfig(pair_tails=1)


@pytest.mark.gpu
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
def test_w13_dgrad_pair_tails_gpu(host_descriptors):
    """The layer's tiles (128 x 256, persistent) with pair_tails and / or dynamic: last tiles
    of 1, 64 (a pair), 65, 100 and 127 rows, one after two whole tiles, whole tiles, an empty
    expert, a one-tile expert; D = 768. The routes' rows equal the plain kernel's bit for bit
    (the same MMAs per row in the same order)."""
    base = W13DgradConfig.from_heuristic(hidden=768, ffn=384, rows_per_expert=256)
    assert base.persistent and base.block_m == 128 and base.pair_tails and base.dynamic
    counts = [129, 192, 0, 256, 193, 228, 64, 255, 1, 300]
    got = {}
    for pair, dynamic in ((False, False), (True, False), (True, True), (False, True)):
        config = replace(base, host_descriptors=host_descriptors, pair_tails=pair,
                         dynamic=dynamic)
        got[pair, dynamic] = _w13_dgrad_pair_tails_case(counts, 768, 384, config)
    for key, value in got.items():
        assert same_bits(value, got[False, False]), key


# the Gluon W13 DGRAD (w2_gluon.launch_gluon_w13_dgrad): last tiles of 1, 64, 65, 100 and
# 127 rows, whole tiles, an empty expert, one-row and 300-row experts; D = 768 (three
# cooperative 256-column tiles), 2F = 768
GLUON_W13D_COUNTS = [129, 192, 0, 256, 193, 228, 64, 255, 1, 300]
# live rows stored nowhere (entry 0): rows 3 and 100 (the first tile's two 64-row halves),
# 1216 (expert 4's last live row, in its last tile), 1299 (inside expert 5's first tile), 1664
# (expert 7's first row), 1920 (the one-row expert 8's only row: a tile whose live rows are
# all skipped); padded offsets 0, 384, 640, 768, 1024, 1280, 1536, 1664, 1920, 2048
GLUON_W13D_NULL = [3, 100, 1216, 1299, 1664, 1920]


def _gluon_w13d_config(warps, stages, hidden=768):
    from distmoe.kernels.w2_gluon import gluon_w13_dgrad_reason

    block_n = 256 if warps == 8 else 128
    config = W13DgradConfig(block_m=128, block_n=block_n, block_k=64, num_warps=warps,
                            num_stages=stages, persistent=True, gluon=True)
    reason = gluon_w13_dgrad_reason(DEVICE, hidden=hidden, ffn=384, block_m=128,
                                    block_n=block_n, block_k=64, stages=stages, warps=warps)
    assert reason is None, f"the Gluon W13 DGRAD would not run here: {reason}"
    return config


@pytest.mark.gpu
@pytest.mark.parametrize("warps, stages, group_m", [(4, 5, 8), (4, 6, 16), (4, 3, 8),
                                                    (8, 4, 8), (8, 3, 16)])
def test_gluon_w13_dgrad(warps, stages, group_m):
    """The Gluon W13 DGRAD through ``w13_dgrad_scatter`` (one program per SM), ping-pong and
    cooperative tiles, against the reference (one fp32 GEMM rounded once; nothing but the
    live, non-null routes written; NaN grad_h1 rows past the live end never reach them)
    and bit for bit against the Triton kernel on the same tiles where both run the same
    MMA instructions in the same K order (cooperative 128 x 256: m64n256k16 per warpgroup)."""
    config = replace(_gluon_w13d_config(warps, stages), group_m=group_m)
    got = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config,
                                     null_rows=GLUON_W13D_NULL)
    triton_cfg = W13DgradConfig(block_m=128, block_n=config.block_n, block_k=64,
                                num_warps=8 if warps == 8 else 4, num_stages=3,
                                persistent=True)
    want = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, triton_cfg,
                                      null_rows=GLUON_W13D_NULL)
    if warps == 8:
        assert same_bits(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
def test_gluon_w13_dgrad_partial_column_tile(warps):
    """D = 832, not a multiple of the tile's 128 or 256 columns (as GPT-OSS's 2880): each
    row's last tile is partial, its weight columns past D TMA zeros, its parts past D not
    stored (the NaN-poisoned output shows a store past a row's end); against the reference
    and, cooperative, bit for bit against the Triton kernel's 128 x 256 tiles."""
    config = _gluon_w13d_config(warps, 4, hidden=832)
    got = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 832, 384, config,
                                     null_rows=GLUON_W13D_NULL)
    if warps == 8:
        triton_cfg = W13DgradConfig(block_m=128, block_n=256, block_k=64, num_warps=8,
                                    num_stages=3, persistent=True)
        want = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 832, 384, triton_cfg,
                                          null_rows=GLUON_W13D_NULL)
        assert same_bits(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_gluon_w13_dgrad_programs_walk_many_tiles(warps, programs):
    """Few programs: each walks many tiles across expert boundaries, its ring's phases wrap
    many times and the ping-pong consumers take turns many times (odd counts included)."""
    from distmoe.kernels.w2_gluon import launch_gluon_w13_dgrad

    config = _gluon_w13d_config(warps, 4)
    launch = partial(launch_gluon_w13_dgrad, block_n=config.block_n, stages=4, warps=warps,
                     programs=programs)
    _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config, null_rows=GLUON_W13D_NULL,
                               launch=launch)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
@pytest.mark.parametrize("programs", [3, None, "twice_the_sms"])
def test_gluon_w13_dgrad_lockstep(warps, programs):
    """``W13DgradConfig.lockstep``: the producers wait on a device counter for the wave
    before each tile. Through ``w13_dgrad_scatter`` with one program per SM; few programs
    walking many tiles (the last wave's idle programs must not hold the others' waits); and
    twice as many programs as SMs over eight times the rows (the programs not resident at
    first make the others' waits miss their bound, after which each stops waiting). Same
    rows as the reference, nothing else written."""
    from distmoe.kernels._common import num_sms
    from distmoe.kernels.w2_gluon import launch_gluon_w13_dgrad

    config = replace(_gluon_w13d_config(warps, 4), lockstep=True)
    if programs is None:
        _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config,
                                   null_rows=GLUON_W13D_NULL)
        return
    counts, null = GLUON_W13D_COUNTS, GLUON_W13D_NULL
    if programs == "twice_the_sms":
        programs = 2 * num_sms(DEVICE)
        counts, null = [8 * n for n in counts], ()
    launch = partial(launch_gluon_w13_dgrad, block_n=config.block_n, stages=4, warps=warps,
                     programs=programs, lockstep=True)
    _w13_dgrad_pair_tails_case(counts, 768, 384, config, null_rows=null, launch=launch)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
@pytest.mark.parametrize("lockstep", [False, True], ids=["free", "lockstep"])
@pytest.mark.parametrize("programs", [1, 3, None])
def test_gluon_w13_dgrad_expert_groups(warps, lockstep, programs):
    """``W13DgradConfig.expert_groups``: each expert's tiles walked column tile by column
    tile over its row blocks (one to three here, with a padding-only tile, an empty expert,
    a one-row expert). A tile missed or taken twice leaves a route unwritten or wrong, or
    writes a canary: through ``w13_dgrad_scatter`` (one program per SM) and with few
    programs walking many tiles."""
    from distmoe.kernels.w2_gluon import launch_gluon_w13_dgrad

    config = replace(_gluon_w13d_config(warps, 4), lockstep=lockstep, expert_groups=True)
    launch = None if programs is None else partial(
        launch_gluon_w13_dgrad, block_n=config.block_n, stages=4, warps=warps,
        programs=programs, lockstep=lockstep, expert_groups=True)
    _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config, null_rows=GLUON_W13D_NULL,
                               launch=launch)


def test_gluon_w13_dgrad_request_that_cannot_run_warns_and_runs_triton():
    """``gluon=True`` where the Gluon kernel cannot run (here: the interpreter, or 32-row
    tiles it is not written for) says why in a RuntimeWarning; the Triton kernel then runs
    the config (pair_tails included) and is checked against the reference."""
    config = W13DgradConfig(block_m=32, block_n=32, block_k=32, num_warps=4, persistent=True,
                            pair_tails=True, gluon=True)
    with pytest.warns(RuntimeWarning, match=r"w13_dgrad_scatter: config\.gluon is set, but the "
                                            r"Gluon kernel cannot run this call \(.+\); the "
                                            r"Triton kernel runs the config instead"):
        _w13_dgrad_pair_tails_case(PAIR_COUNTS, 40, 24, config, null_rows=[2])


def test_gluon_w13_dgrad_rules():
    """The config field's type, and the shape rules of the Gluon W13 DGRAD (whatever the
    device): its two tiles, ring depths that fit, D and 2F multiples of 64 (a row's last
    column tile may be partial)."""
    from distmoe.kernels.w2_gluon import shape_reason

    with pytest.raises(TypeError, match="gluon must be a bool, got int"):
        W13DgradConfig(gluon=1)
    with pytest.raises(TypeError, match="lockstep must be a bool, got str"):
        W13DgradConfig(gluon=True, lockstep="yes")
    with pytest.raises(TypeError, match="expert_groups must be a bool, got int"):
        W13DgradConfig(gluon=True, expert_groups=1)
    rule = partial(shape_reason, block_m=128, block_k=64, w13_dgrad=True)
    assert rule(hidden=768, ffn=384, block_n=256, stages=4, warps=8) is None
    assert rule(hidden=768, ffn=384, block_n=128, stages=6, warps=4) is None
    assert rule(hidden=768, ffn=32, block_n=128, stages=6, warps=4) is None  # 2F = 64
    assert rule(hidden=768, ffn=48, block_n=128, stages=6, warps=4) == (
        "D (768) must be a multiple of 64 and 2F (96) of 64")
    assert rule(hidden=640, ffn=384, block_n=256, stages=4, warps=8) is None  # 2.5 tiles
    assert rule(hidden=672, ffn=384, block_n=256, stages=4, warps=8) == (
        "D (672) must be a multiple of 64 and 2F (768) of 64")
    assert "the Gluon W13 DGRAD kernel runs (block_m, block_n, block_k, num_warps) in" in rule(
        hidden=768, ffn=384, block_n=256, stages=4, warps=4)
    assert rule(hidden=768, ffn=384, block_n=256, stages=5, warps=8) == (
        "stages must be one of [3, 4] with block_n = 256 and num_warps = 8, got 5")
    # the W2 forward's rules name F, not 2F
    assert shape_reason(hidden=768, ffn=96, block_m=128, block_n=128, block_k=64, stages=6,
                        warps=4) == "D (768) must be a multiple of 64 and F (96) of 64"


def test_gluon_w13_dgrad_heuristic_rules():
    """Where the heuristic takes the Gluon W13 DGRAD (whatever the device): ping-pong 128 x
    128 tiles, 6 stages from 256 rows per expert and 5 below, from 128 rows per expert while
    the rank's W13 weights total under 2 GiB and the kernel tiles the shape; elsewhere the
    Triton pick. Off a Hopper GPU (here: the CPU) the pick stays the Triton one."""
    pick = W13DgradConfig.hopper_gluon
    tile = lambda c: (c.gluon, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    # T=4096 D=2048 F=768 E=128 (256 rows per expert), T=2048 (128), OLMoE, T=8192 D=4096
    # F=2048 E=32: the measured wins of run 44
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=256, num_experts=128)) == (
        True, 128, 4, 6)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=128, num_experts=128)) == (
        True, 128, 4, 5)
    assert tile(pick(hidden=2048, ffn=1024, rows_per_expert=512, num_experts=64)) == (
        True, 128, 4, 6)
    assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=2048, num_experts=32)) == (
        True, 128, 4, 6)
    # DeepSeek-V3 (15 GB of W13 weights) and V4-Flash (8 GB): slower with Gluon (run 44);
    # DeepSeek-V3's experts (56 MiB each) stay on Triton with 32 per rank too (1.75 GiB in
    # all); V4-Flash's (32 MiB, the bound) take Gluon there
    assert pick(hidden=7168, ffn=2048, rows_per_expert=128, num_experts=256) is None
    assert pick(hidden=4096, ffn=2048, rows_per_expert=192, num_experts=256) is None
    assert pick(hidden=7168, ffn=2048, rows_per_expert=128, num_experts=32) is None
    assert pick(hidden=4096, ffn=2048, rows_per_expert=192, num_experts=32).gluon
    assert pick(hidden=4096, ffn=2080, rows_per_expert=192, num_experts=8) is None  # > 32 MiB
    # the bound: 64 experts of 2F*D = 2^24 values are exactly 2 GiB; one fewer is under it
    assert pick(hidden=4096, ffn=2048, rows_per_expert=256, num_experts=64) is None
    assert pick(hidden=4096, ffn=2048, rows_per_expert=256, num_experts=63).gluon
    # fewer rows, no expert count, a width the kernel cannot tile
    assert pick(hidden=2048, ffn=768, rows_per_expert=127, num_experts=128) is None
    assert pick(hidden=2048, ffn=768, rows_per_expert=256, num_experts=None) is None
    assert pick(hidden=2912, ffn=2880, rows_per_expert=256, num_experts=8) is None
    # D = 2880 (GPT-OSS): a partial last column tile; 8 experts are 0.25 GiB, 128 are 4 GiB
    assert tile(pick(hidden=2880, ffn=2880, rows_per_expert=256, num_experts=8)) == (
        True, 128, 4, 6)
    assert pick(hidden=2880, ffn=2880, rows_per_expert=128, num_experts=128) is None
    # the expert-group tile order at 128 to 512 rows per expert (run 59: 1.043x at the first
    # shape above, 1.009x at OLMoE, 0.951x at 2048 rows per expert; run 60: the kernel
    # 1.05-1.25x at 128-512, 0.986x at 1024)
    groups = lambda rows, **kw: pick(hidden=2048, ffn=768, rows_per_expert=rows,  # noqa: E731
                                     num_experts=128, **kw).expert_groups
    assert groups(128) and groups(255) and groups(256) and groups(512)
    assert not any(groups(rows) for rows in (513, 1024, 2048))
    assert pick(hidden=2048, ffn=1024, rows_per_expert=512, num_experts=64).expert_groups
    assert not pick(hidden=4096, ffn=2048, rows_per_expert=2048, num_experts=32).expert_groups
    triton_pick = W13DgradConfig.from_heuristic(hidden=2048, ffn=768, rows_per_expert=256)
    assert not triton_pick.gluon and triton_pick.dynamic and triton_pick.pair_tails
    assert W13DgradConfig.from_heuristic(hidden=2048, ffn=768, rows_per_expert=256,
                                         device=torch.device("cpu"),
                                         num_experts=128) == triton_pick


@pytest.mark.gpu
def test_gluon_w13_dgrad_heuristic_gpu():
    """On a Hopper GPU the layer's pick (hint and local expert count given) is the Gluon
    kernel where :meth:`W13DgradConfig.hopper_gluon` takes it, else the Triton pick."""
    if torch.cuda.get_device_capability(DEVICE)[0] != 9:
        pytest.skip("the Gluon W13 DGRAD is for compute capability 9.x")
    pick = partial(W13DgradConfig.from_heuristic, device=DEVICE)
    fine = pick(hidden=2048, ffn=768, rows_per_expert=256, num_experts=128)
    assert (fine.gluon, fine.block_n, fine.num_warps, fine.num_stages) == (True, 128, 4, 6)
    dsv3 = pick(hidden=7168, ffn=2048, rows_per_expert=128, num_experts=256)
    assert not dsv3.gluon and dsv3.pair_tails
    assert not pick(hidden=2048, ffn=768, rows_per_expert=256).gluon  # no expert count


def test_gluon_w13_dgrad_config_reaches_the_launch(monkeypatch):
    """The config's tile reaches the Gluon launch (``num_warps``, ``block_n``, ``num_stages``,
    ``group_m``), on any machine: the launcher is a recorder and the check admits the case.
    ``gluon=False`` never calls either."""
    import distmoe.kernels.w2_gluon as wg

    calls = []
    monkeypatch.setattr(wg, "gluon_w13_dgrad_reason",
                        lambda device, **kw: calls.append(("reason", kw)) and None)
    monkeypatch.setattr(wg, "launch_gluon_w13_dgrad",
                        lambda *a, **kw: calls.append(("launch", kw)))
    layout, w13, grad_h1 = _w13_problem(5, 256, 32, 128, [0, 1, 4])
    dispatch, canary, ptrs = _w13_targets(layout, 256)
    before = dispatch.clone()
    for warps, block_n, stages, group_m in ((4, 128, 6, 8), (8, 256, 3, 16)):
        calls.clear()
        config = W13DgradConfig(block_m=128, block_n=block_n, block_k=64, num_warps=warps,
                                num_stages=stages, group_m=group_m, gluon=True)
        w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                          config=config)
        (_, reason), (_, launch) = calls
        assert (reason["block_n"], reason["warps"], reason["stages"]) == (block_n, warps, stages)
        assert (launch["block_n"], launch["warps"], launch["stages"], launch["group_m"]) == (
            block_n, warps, stages, group_m)
        assert launch["lockstep"] is False and launch["expert_groups"] is False
    calls.clear()
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                      config=replace(config, lockstep=True))
    assert calls[1][1]["lockstep"] is True and calls[1][1]["expert_groups"] is False
    calls.clear()
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                      config=replace(config, expert_groups=True))
    assert calls[1][1]["expert_groups"] is True and calls[1][1]["lockstep"] is False
    assert same_bits(dispatch, before)  # the recorder launched nothing
    calls.clear()
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                      config=W13DgradConfig(block_m=128, block_n=128, block_k=32, num_warps=4))
    assert calls == []
    assert not same_bits(dispatch, before)  # the Triton kernel ran


@pytest.mark.parametrize("counts", [[0, 0, 0], [0, 5, 0]], ids=["no_live_tile", "two_tiles"])
def test_dgrad_persistent_few_tiles(counts):
    """Fewer live tiles than persistent programs (none, or 2 of the interpreter's 3): programs
    without a tile exit at once; the outputs equal the tile grid's bit for bit (poison kept)."""
    hidden, ffn, block_m = 48, 40, 16  # two column tiles of 32 in both kernels
    layout = layout_from_counts(counts, block_m)
    num_act = layout.num_act
    combine = torch.randn(max(sum(counts), 1), hidden, device=DEVICE).bfloat16()
    ptrs = row_table(layout, combine)
    w2 = (torch.randn(3, hidden, ffn, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    h1 = torch.randn(num_act, 2 * ffn, device=DEVICE).bfloat16()
    h1[~layout.live_act()] = float("nan")
    w13 = (torch.randn(3, 2, ffn, hidden, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    outs = {}
    for persistent in (False, True):
        cfg = dict(block_m=block_m, block_n=32, block_k=32, num_warps=4, persistent=persistent)
        grad_h1, h2, grad_h3 = (poisoned(num_act, w) for w in (2 * ffn, ffn, hidden))
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                            h2_out=h2, grad_h3_out=grad_h3, config=W2DgradConfig(**cfg))
        dispatch = poisoned(max(sum(counts), 1), hidden)
        w13_dgrad_scatter(h1, layout.padded_offsets, layout.row_offsets, w13,
                          row_table(layout, dispatch), config=W13DgradConfig(**cfg))
        outs[persistent] = (grad_h1, h2, grad_h3, dispatch)
    for got, want in zip(outs[True], outs[False], strict=True):
        assert same_bits(got, want)
    if sum(counts) == 0:  # nothing written at all
        for out in outs[True]:
            assert out.isnan().all()
    else:
        assert not outs[True][3].isnan().any()  # every route row written


# --------------------------------------------------------------------------------------------
# WGRAD (W2 and W13)
# --------------------------------------------------------------------------------------------


def _wgrad_operand(layout, width, *, big_experts):
    """bf16 [R_act, width] activation rows; rows of ``big_experts`` scaled by 2^10 (what the
    last, partial row step of the expert before them loads), NaN in the spare rows."""
    out = torch.randn(layout.num_act, width, device=DEVICE)
    rows = layout.row_offsets.tolist()
    for e in big_experts:
        out[rows[e] : rows[e + 1]] *= 1024.0
    out = out.bfloat16()
    out[~layout.live_act()] = float("nan")
    return out


@pytest.mark.parametrize("split_rows", [1, 3])
@pytest.mark.parametrize("one_expert", [False, True])
def test_w2_wgrad(split_rows, one_expert):
    num_experts, hidden, ffn, block_m = 5, 48, 40, 16
    # Live rows per expert (block_k 16): partial last steps of 5 rows, an empty expert, a
    # whole-step count (32) and, with split_rows 3, programs whose only step is partial.
    counts = [0, 0, 0, 45, 0] if one_expert else [21, 0, 32, 37, 5]
    layout = layout_from_counts(counts, block_m, extra_tiles={1: 1})
    grad_h3 = _wgrad_operand(layout, hidden, big_experts=[2, 4])
    h2 = _wgrad_operand(layout, ffn, big_experts=[2, 4])
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

    w2_wgrad(grad_h3, h2, layout.padded_offsets, layout.row_offsets, grad_w2, config=config)

    assert_wgrad_close(grad_w2, grad_h3, h2, layout, before, rows_sum=w2_wgrad_ref)
    for e, count in enumerate(counts):
        if count == 0:  # experts without rows: bit-exact untouched
            assert same_bits(grad_w2[e], before[e])


@pytest.mark.parametrize(
    "split_rows,host_descriptors",
    [(1, True), (2, False)],  # split rows with atomics; TMA descriptors built in the kernel
)
def test_w13_wgrad(split_rows, host_descriptors):
    num_experts, hidden, ffn, block_m = 3, 40, 24, 32
    counts = [40, 0, 19]  # expert 1: no rows; partial last steps (8 and 3 rows)
    layout = layout_from_counts(counts, block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    x = _wgrad_operand(layout, hidden, big_experts=[2])
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

    w13_wgrad(grad_h1, x, layout.padded_offsets, layout.row_offsets, grad_w13, config=config)

    assert_wgrad_close(grad_w13, grad_h1, x, layout, before, rows_sum=w13_wgrad_ref)
    assert same_bits(grad_w13[1], before[1])


@pytest.mark.parametrize("host_descriptors", [True, False])
def test_w13_wgrad_x_offset(host_descriptors):
    """x_gathered at a device-side offset into a 1-D base (device-built descriptor, bounded by
    the live rows): bit-exact equal to the plain path (same row steps, same order)."""
    num_experts, hidden, ffn, block_m = 3, 40, 24, 32
    layout = layout_from_counts([40, 0, 19], block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    x = _wgrad_operand(layout, hidden, big_experts=[2])
    before = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    config = WgradConfig(
        block_m=block_m,
        block_k=16,
        block_out_m=32,
        block_out_n=16,
        num_warps=4,
        num_stages=2,
        host_descriptors=host_descriptors,
    )
    plain = before.clone()
    w13_wgrad(grad_h1, x, layout.padded_offsets, layout.row_offsets, plain, config=config)

    offset = 8 * 9  # elements: 16-byte aligned, not a multiple of a row (D = 40)
    # Only the live rows sit in the base, followed by NaN: nothing past row_offsets[E] is read.
    live_x = x[: layout.live_end].reshape(-1)
    base = torch.full((offset + live_x.numel() + 3 * hidden,), float("nan"), device=DEVICE)
    base = base.bfloat16()
    base[offset : offset + live_x.numel()] = live_x
    x_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    got = before.clone()
    w13_wgrad(
        grad_h1,
        base,
        layout.padded_offsets,
        layout.row_offsets,
        got,
        x_offset=x_offset,
        config=config,
    )
    assert same_bits(got, plain)


def kept_x_rows(layout: Layout, hidden: int, *, top_k: int = 2, null_every: int = 7):
    """What a layer that kept its input hands the W13 WGRAD at EP = 1: token-major x
    ``[T, D]`` (token = route // ``top_k``) inside a NaN-poisoned 1-D base at an offset, and a
    table naming, by padded row, rows of another buffer (``origin``'s rows, never read) with
    the same pitch. Every ``null_every``-th live row is null (0: zeros); padding and idle rows
    name the NaN row just past x (read, it shows). Returns ``(base, x_offset, table, origin,
    x_gathered, origin_buffer)``: ``x_gathered`` the ``[R_act, D]`` rows the table stands
    for (NaN in spare rows), ``origin_buffer`` what ``origin`` points into (keep it alive)."""
    route = layout.route_of_row
    tokens = max(1, int(route.max()) // top_k + 1)
    x_tok = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    offset = 8 * 3  # elements: 16-byte aligned, not a multiple of a row
    base = poisoned(offset + (tokens + 1) * hidden)
    base[offset:offset + tokens * hidden] = x_tok.reshape(-1)
    origin_buffer = poisoned(tokens + 1, hidden)
    null = (route >= 0) & (torch.arange(route.numel()) % null_every == 3)
    # padding and idle rows: the row past x's tokens (its shifted address is base's NaN row)
    table = row_table(layout, origin_buffer, canary=origin_buffer[tokens:], null_rows=null,
                      top_k=top_k)
    x_gathered = act_rows(layout, x_tok, top_k=top_k)
    x_gathered[layout.act_of_row[null].to(DEVICE)] = 0
    # [offset, 0]: the rows through the table (the second entry is in_order_rows' switch)
    x_offset = torch.tensor([offset, 0], dtype=torch.int64, device=DEVICE)
    return base, x_offset, table, origin_buffer.data_ptr(), x_gathered, origin_buffer


def in_order_rows(x_gathered: torch.Tensor, origin: int):
    """The other way of the x_rows path: rows stored in activation order (a layer that kept
    its gathered rows) inside a NaN-poisoned 1-D base at an offset, and ``x_offset`` ``[offset,
    origin]`` telling the kernel to leave the table unread. Returns ``(base, x_offset)``."""
    rows, hidden = x_gathered.shape
    offset = 8 * 5
    base = poisoned(offset + (rows + 1) * hidden)
    base[offset:offset + rows * hidden] = x_gathered.reshape(-1)
    return base, torch.tensor([offset, origin], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize(
    "split_rows,host_descriptors,accumulate",
    [(1, True, True), (2, False, True), (1, True, False), (1, False, False)],
)
def test_w13_wgrad_x_rows(split_rows, host_descriptors, accumulate):
    """x's rows read in place through the gather table (``x_rows``): the same bits as the
    same kernel over the gathered rows stored in order (same row steps, same order; split
    rows add their partial sums by atomics, in an order that varies between runs on a GPU,
    so there within fp32 rounding of the sum), with null rows (zeros), NaN where a padding
    row's address points, NaN around x, and an empty expert and partial last steps."""
    num_experts, hidden, ffn, block_m = 4, 40, 24, 32
    layout = layout_from_counts([40, 0, 19, 33], block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    base, x_offset, table, origin, x_gathered, _keep = kept_x_rows(layout, hidden)
    before = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    config = WgradConfig(block_m=block_m, block_k=16, block_out_m=32, block_out_n=16,
                         split_rows=split_rows, num_warps=4, num_stages=2,
                         host_descriptors=host_descriptors)
    po, ro = layout.padded_offsets, layout.row_offsets
    plain = before.clone() if accumulate else poisoned(*before.shape, dtype=torch.float32)
    w13_wgrad(grad_h1, x_gathered, po, ro, plain, accumulate=accumulate, config=config)
    got = before.clone() if accumulate else poisoned(*before.shape, dtype=torch.float32)
    w13_wgrad(grad_h1, base, po, ro, got, x_offset=x_offset, accumulate=accumulate,
              config=config, x_rows=table, rows_origin=origin)
    # the same launch with the rows stored in order and the switch set: the table (all null
    # here, so read it would give zeros) is left unread
    ordered_base, ordered_offset = in_order_rows(x_gathered, origin)  # NaN past the live rows
    ordered = before.clone() if accumulate else poisoned(*before.shape, dtype=torch.float32)
    w13_wgrad(grad_h1, ordered_base, po, ro, ordered, x_offset=ordered_offset,
              accumulate=accumulate, config=config, x_rows=torch.zeros_like(table),
              rows_origin=origin)
    assert torch.isfinite(got).all() and torch.isfinite(ordered).all()
    bound = 4 * 2.0**-24 * (before.abs() + w13_wgrad_ref(
        grad_h1.abs(), x_gathered.abs(), po, ro, torch.zeros_like(before)))
    for result in (got, ordered):
        if split_rows == 1 or DEVICE.type == "cpu":
            assert same_bits(result, plain)
        else:  # fp32 atomics: a few roundings of the accumulated magnitude apart
            assert ((result - plain).abs() <= bound).all()
    if accumulate:
        assert_wgrad_close(got, grad_h1, x_gathered, layout, before, rows_sum=w13_wgrad_ref)


@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_overwrite(out_dtype, host_descriptors):
    """accumulate=False: every element written (zeros for the expert without rows) over a
    NaN-poisoned output; fp32 equals accumulating into zeros bit for bit (same row steps, same
    order, and 0 + acc is exact); bf16 is that fp32 result rounded once (RNE)."""
    num_experts, hidden, ffn, block_m = 3, 40, 24, 32
    layout = layout_from_counts([40, 0, 19], block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    x = _wgrad_operand(layout, hidden, big_experts=[2])
    grad_h3 = _wgrad_operand(layout, hidden, big_experts=[2])
    h2 = _wgrad_operand(layout, ffn, big_experts=[2])
    config = WgradConfig(block_m=block_m, block_k=16, block_out_m=32, block_out_n=16,
                         num_warps=4, num_stages=2, host_descriptors=host_descriptors)
    po, ro = layout.padded_offsets, layout.row_offsets
    acc13 = torch.zeros(num_experts, 2, ffn, hidden, device=DEVICE)
    w13_wgrad(grad_h1, x, po, ro, acc13, config=config)
    acc2 = torch.zeros(num_experts, hidden, ffn, device=DEVICE)
    w2_wgrad(grad_h3, h2, po, ro, acc2, config=config)
    got13 = poisoned(num_experts, 2, ffn, hidden, dtype=out_dtype)
    w13_wgrad(grad_h1, x, po, ro, got13, accumulate=False, config=config)
    got2 = poisoned(num_experts, hidden, ffn, dtype=out_dtype)
    w2_wgrad(grad_h3, h2, po, ro, got2, accumulate=False, config=config)
    assert same_bits(got13, acc13.to(out_dtype)) and same_bits(got2, acc2.to(out_dtype))
    assert not got13[1].any() and not got2[1].any()  # the expert without rows: zeros
    # The epilogue is a TMA store when out is 16-byte aligned (above), pointer stores when not
    # (an out starting one element into its storage): same bits.
    unaligned = poisoned(num_experts * hidden * ffn + 1, dtype=out_dtype)[1:]
    unaligned = unaligned.view(num_experts, hidden, ffn)
    assert unaligned.data_ptr() % 16
    w2_wgrad(grad_h3, h2, po, ro, unaligned, accumulate=False, config=config)
    assert same_bits(unaligned, got2)
    split = WgradConfig(block_m=block_m, block_k=16, block_out_m=32, block_out_n=16,
                        split_rows=2, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match=r"accumulate=False needs config.split_rows == 1"):
        w2_wgrad(grad_h3, h2, po, ro, got2, accumulate=False, config=split)
    with pytest.raises(TypeError, match=r"grad_w2 must have dtype .*float32.*, got torch.bfloat16"):
        w2_wgrad(grad_h3, h2, po, ro, got2.bfloat16(), config=config)


# --------------------------------------------------------------------------------------------
# The whole backward chain against autograd
# --------------------------------------------------------------------------------------------


def _run_chain(x, ids, scores, w13, w2, grad_y, *, block_m, configs, t_max, offsets,
               scored=False):
    """Saved forward state from the fp64 reference rounded to bf16 (what the forward kernels
    keep), then the six backward kernels in order. ``offsets``: the saved state in one 1-D
    slot at device-side offsets (h1_offset with grad_h1 in place, x_offset) and h3 read in
    place from the combine buffer (h3_addr); else plain tensors. ``scored``: the layer's
    order instead (push_route_grads, the W2 DGRAD computing the score gradients into the
    combine rows, reduce_routes summing them; no h3 read). Returns (grad_x, grad_scores,
    grad_w13, grad_w2 increments)."""
    num_tokens, top_k = ids.shape
    num_experts, _, ffn, hidden = w13.shape
    layout = build_layout(ids.cpu(), num_experts, block_m, extra_tiles={0: 1})
    rows = layout.row_offsets.tolist()
    num_act = layout.num_act

    # Forward state in activation rows: x_gathered, h1 (bf16), h3 per route slot (bf16).
    x_gathered = act_rows(layout, x, top_k=top_k)
    h1_exact = torch.zeros(num_act, 2 * ffn, dtype=torch.float64, device=DEVICE)
    h3_exact = torch.zeros(num_act, hidden, dtype=torch.float64, device=DEVICE)
    for e in range(num_experts):
        r = slice(rows[e], rows[e + 1])
        h1_exact[r] = x_gathered[r].double() @ w13[e].double().reshape(2 * ffn, hidden).t()
        g, u = h1_exact[r, :ffn], h1_exact[r, ffn:]
        h3_exact[r] = (torch.nn.functional.silu(g) * u) @ w2[e].double().t()
    live = layout.live_act()
    h1 = h1_exact.bfloat16()
    h1[~live] = float("nan")
    route_of_act = layout.route_of_act.to(DEVICE)
    h3_routes = poisoned(t_max * top_k, hidden)
    h3_routes[route_of_act[live]] = h3_exact[live].bfloat16()

    # Owner buffers (combine / dispatch) and outputs, poisoned.
    combine = poisoned(t_max * top_k, hidden)
    dispatch = poisoned(t_max * top_k, hidden)
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    grad_x = poisoned(num_tokens, hidden)
    grad_h3 = poisoned(num_act, hidden)
    h2 = poisoned(num_act, ffn)
    grad_w2_before = torch.randn(num_experts, hidden, ffn, device=DEVICE)
    grad_w13_before = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    grad_w2, grad_w13 = grad_w2_before.clone(), grad_w13_before.clone()

    score_parts = None
    if scored:
        # Every route's activation row (the push's destination), one rank.
        dest_rows = torch.full((num_tokens * top_k,), -1, dtype=torch.int32, device=DEVICE)
        dest_rows[route_of_act[live]] = torch.arange(num_act, device=DEVICE)[live].int()
        push_route_grads(grad_y, ids, scores, combine,
                         dest_rows=dest_rows.reshape(num_tokens, top_k),
                         dest_bases=torch.tensor([grad_h3.data_ptr()], device=DEVICE),
                         experts_per_rank=num_experts)
        score_parts = -(-ffn // configs["w2_dgrad"].block_n)
    if offsets:
        # One slot: [8 lead elements | x_gathered rows | h1 rows], offsets on the device.
        x_off, h1_off = 8, 8 + num_act * hidden
        slot = poisoned(h1_off + num_act * 2 * ffn)
        slot[x_off:h1_off] = x_gathered.reshape(-1)
        slot[h1_off:] = h1.reshape(-1)
        x_offset = torch.tensor([x_off], dtype=torch.int64, device=DEVICE)
        h1_offset = torch.tensor([h1_off], dtype=torch.int64, device=DEVICE)
        grad_h1 = slot[h1_off:].view(num_act, 2 * ffn)  # in place over the h1 rows
        if not scored:
            combine.copy_(h3_routes)  # the combine buffer still holds the routes' results
            h3_addr = torch.tensor([combine.data_ptr()], dtype=torch.int64, device=DEVICE)
            route_grads(grad_y, None, ids, scores, combine, grad_scores, h3_addr=h3_addr)
        h1_arg, x_arg = slot, slot
    else:
        x_offset = h1_offset = None
        grad_h1 = h1  # in place
        if not scored:
            route_grads(grad_y, h3_routes, ids, scores, combine, grad_scores)
        h1_arg, x_arg = h1, x_gathered
    w2_dgrad_swiglu_bwd(
        row_table(layout, combine),
        layout.padded_offsets,
        layout.row_offsets,
        w2,
        h1_arg,
        grad_h1,
        h1_offset=h1_offset,
        h2_out=h2,
        grad_h3_out=None if scored else grad_h3,
        grad_h3_rows=grad_h3 if scored else None,
        scored_rows=scored,
        config=configs["w2_dgrad"],
    )
    w2_wgrad(
        grad_h3,
        h2,
        layout.padded_offsets,
        layout.row_offsets,
        grad_w2,
        config=configs["w2_wgrad"],
    )
    w13_dgrad_scatter(
        grad_h1,
        layout.padded_offsets,
        layout.row_offsets,
        w13,
        row_table(layout, dispatch),
        config=configs["w13_dgrad"],
    )
    w13_wgrad(
        grad_h1,
        x_arg,
        layout.padded_offsets,
        layout.row_offsets,
        grad_w13,
        x_offset=x_offset,
        config=configs["w13_wgrad"],
    )
    if scored:
        reduce_routes(dispatch, ids, grad_x, score_rows=combine, score_parts=score_parts,
                      grad_scores_out=grad_scores)
    else:
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


def _chain_check(
    num_tokens, top_k, num_experts, experts, hidden, ffn, block_m, configs, *, offsets=False,
    scored=False,
):
    t_max = num_tokens + 2
    x = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    ids = make_ids(num_tokens, top_k, experts).to(DEVICE)
    scores = torch.rand(num_tokens, top_k, device=DEVICE) * (ids >= 0)
    w13 = (torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    grad_y = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()

    ours = _run_chain(
        x,
        ids,
        scores,
        w13,
        w2,
        grad_y,
        block_m=block_m,
        configs=configs,
        t_max=t_max,
        offsets=offsets,
        scored=scored,
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


@pytest.mark.parametrize("scored", [False, True], ids=["owner_scores", "expert_scores"])
@pytest.mark.parametrize("offsets", [False, True])
def test_backward_chain(offsets, scored):
    block_m = 16
    configs = {
        # scored: two column tiles of F, two score parts per route
        "w2_dgrad": W2DgradConfig(block_m=block_m, block_n=16 if scored else 32, block_k=32,
                                  num_warps=4),
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
        offsets=offsets,
        scored=scored,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("scored", [False, True], ids=["owner_scores", "expert_scores"])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("hint", [None, 2048], ids=["no_hint", "layer_hint"])
def test_backward_chain_gpu_default_configs(offsets, hint, scored):
    # Production tiles (block_m 128, 8 warps, TMA, pipelined row loops). With the layer's
    # shape hint: the tuned 128 x 256 DGRAD tiles (F = 384: a half-empty last tile), the
    # persistent W13 DGRAD grid and 128 x 256 WGRAD tiles.
    configs = {
        "w2_dgrad": W2DgradConfig.from_heuristic(hidden=512, ffn=384, rows_per_expert=hint),
        "w2_wgrad": WgradConfig.from_heuristic(out_rows=512, out_cols=384, rows_per_expert=hint),
        "w13_dgrad": W13DgradConfig.from_heuristic(hidden=512, ffn=384, rows_per_expert=hint),
        "w13_wgrad": WgradConfig.from_heuristic(out_rows=768, out_cols=512,
                                                rows_per_expert=hint),
    }
    if hint is not None:
        assert configs["w2_dgrad"].block_n == configs["w13_dgrad"].block_n == 256
    _chain_check(
        num_tokens=300,
        top_k=4,
        num_experts=6,
        experts=[0, 1, 2, 4, 5],
        hidden=512,
        ffn=384,
        block_m=128,
        configs=configs,
        offsets=offsets,
        scored=scored,
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
    # Persistent grids: accepted, swept, never the default (until measured on an H200).
    for cls in (W2DgradConfig, W13DgradConfig):
        assert cls(persistent=True).persistent
        assert not cls.from_heuristic(hidden=4096, ffn=2048).persistent
        swept = cls.all_configs(hidden=4096, ffn=2048)
        assert {c.persistent for c in swept} == {False, True}
        tiles = [replace(c, persistent=False) for c in swept if c.persistent]
        assert tiles and all(c in swept for c in tiles)  # a persistent twin of each tile grid
    # With the layer's shape hint (balanced rows per local expert): the tuned 128 x 256 tiles
    # when the dimension they split is wide enough, else the defaults above.
    w2d = W2DgradConfig.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048)
    assert (w2d.block_n, w2d.num_stages, w2d.persistent) == (256, 4, False)
    # the Gluon W2 DGRAD only where it runs (a Hopper GPU outside the interpreter)
    cpu = W2DgradConfig.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048,
                                       device=torch.device("cpu"))
    assert cpu == w2d and not cpu.gluon
    w13d = W13DgradConfig.from_heuristic(hidden=2048, ffn=768, rows_per_expert=256)
    assert (w13d.block_n, w13d.num_stages, w13d.persistent) == (256, 4, True)
    assert w13d.dynamic and w13d.pair_tails  # run 40: the layer's tiles, handed out
    assert w2d.fits_hopper() and w13d.fits_hopper()
    for cls in (W2DgradConfig, W13DgradConfig):
        assert cls.from_heuristic(hidden=128, ffn=128, rows_per_expert=2048) \
            == cls.from_heuristic(hidden=128, ffn=128)
        assert cls.from_heuristic(hidden=4096, ffn=2048, block_m=64, rows_per_expert=2048) \
            == cls.from_heuristic(hidden=4096, ffn=2048, block_m=64)


def test_validation_errors():
    ffn, hidden, rows = 16, 32, 32
    w2 = torch.zeros(2, hidden, ffn, dtype=torch.bfloat16, device=DEVICE)
    ptrs = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    row_offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    h1 = torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    cfg = W2DgradConfig(block_m=16, block_n=16, block_k=16, num_warps=4)
    with pytest.raises(TypeError, match=r"grad_h3_ptrs must have dtype int64, got torch.int32"):
        w2_dgrad_swiglu_bwd(ptrs.int(), offsets, row_offsets, w2, h1, h1.clone(), config=cfg)
    with pytest.raises(
        ValueError, match=r"h1 must have shape \[32, 32\] \[R_act, 2F\] like grad_h1_out"
    ):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, h1[:, :24], h1.clone(), config=cfg)
    with pytest.raises(ValueError, match=r"R_cap \(24\) must be a multiple of config.block_m"):
        w2_dgrad_swiglu_bwd(ptrs[:24], offsets, row_offsets, w2, h1, h1.clone(), config=cfg)
    scratch = torch.zeros(rows * 3 * ffn, dtype=torch.bfloat16, device=DEVICE)
    grad_h1 = scratch[: rows * 2 * ffn].view(rows, 2 * ffn)
    h2_overlapping = scratch[rows * ffn : rows * 2 * ffn].view(rows, ffn)
    with pytest.raises(ValueError, match=r"grad_h1_out and h2_out must not overlap in memory"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, h1, grad_h1, h2_out=h2_overlapping, config=cfg
        )
    shifted = torch.zeros((rows + 1) * 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"h1 and grad_h1_out must not overlap in memory"):
        w2_dgrad_swiglu_bwd(
            ptrs,
            offsets,
            row_offsets,
            w2,
            shifted[: rows * 2 * ffn].view(rows, 2 * ffn),
            shifted[2 * ffn :].view(rows, 2 * ffn),  # one row further: not the same rows
            config=cfg,
        )
    with pytest.raises(ValueError, match=r"padded_offsets must have shape \[3\]"):
        w2_dgrad_swiglu_bwd(ptrs, offsets[:2], row_offsets, w2, h1, h1.clone(), config=cfg)
    with pytest.raises(TypeError, match=r"config must be a W2DgradConfig"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, h1, h1.clone(), config=WgradConfig())
    with pytest.raises(ValueError, match=r"F \(w2.shape\[2\]\) \(12\) must be a positive multiple"):
        w2_dgrad_swiglu_bwd(
            ptrs,
            offsets,
            row_offsets,
            w2[..., :12].contiguous(),
            h1[:, :24].contiguous(),
            h1[:, :24].contiguous(),
            config=cfg,
        )
    grad_w2 = torch.zeros(2, hidden, ffn, device=DEVICE)
    grad_h3 = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match=r"grad_w2 must have dtype float32, got torch.bfloat16"):
        w2_wgrad(grad_h3, h1[:, :ffn], offsets, row_offsets, grad_w2.bfloat16())
    with pytest.raises(ValueError, match=r"h2 must be contiguous"):
        w2_wgrad(grad_h3, h1[:, :ffn], offsets, row_offsets, grad_w2)
    with pytest.raises(
        ValueError, match=r"h2 must have shape \[32, 16\] \[R_act, F\] like grad_h3, got \[16, 16\]"
    ):
        w2_wgrad(grad_h3, h1[:16, :ffn].contiguous(), offsets, row_offsets, grad_w2)
    w13 = torch.zeros(2, 2, ffn, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"w13 must have shape \[E_local, 2, F, D\]"):
        w13_dgrad_scatter(h1, offsets, row_offsets, w13.reshape(2, 4, ffn // 2, hidden), ptrs)
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


def test_validation_errors_new_arguments():
    """row_offsets, h1_offset, x_offset and h3_addr: each rule named with its value."""
    ffn, hidden, rows = 16, 32, 32
    w2 = torch.zeros(2, hidden, ffn, dtype=torch.bfloat16, device=DEVICE)
    ptrs = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    row_offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    h1 = torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    base = torch.zeros(8 + rows * 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    off = torch.tensor([8], dtype=torch.int64, device=DEVICE)
    cfg = W2DgradConfig(block_m=16, block_n=16, block_k=16, num_warps=4)

    # row_offsets (every kernel that takes it)
    with pytest.raises(TypeError, match=r"row_offsets must have dtype int32, got torch.int64"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets.long(), w2, h1, h1.clone(), config=cfg)
    with pytest.raises(
        ValueError, match=r"row_offsets must have shape \[3\] \[E_local \+ 1\].*got \[2\]"
    ):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets[:2], w2, h1, h1.clone(), config=cfg)
    grad_w2 = torch.zeros(2, hidden, ffn, device=DEVICE)
    grad_h3 = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"row_offsets must have shape \[3\]"):
        w2_wgrad(grad_h3, h1[:, :ffn].contiguous(), offsets, row_offsets[:2], grad_w2)
    w13 = torch.zeros(2, 2, ffn, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match=r"row_offsets must be a torch.Tensor, got list"):
        w13_dgrad_scatter(h1, offsets, [0, 0, 0], w13, ptrs)
    with pytest.raises(ValueError, match=r"grad_h1 must have shape \[R_act, 32\].*got \[32, 24\]"):
        w13_dgrad_scatter(h1[:, :24].contiguous(), offsets, row_offsets, w13, ptrs)

    # h1_offset
    with pytest.raises(TypeError, match=r"h1_offset must have dtype int64, got torch.int32"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base, h1, h1_offset=off.int(), config=cfg
        )
    with pytest.raises(ValueError, match=r"h1_offset must have shape \[1\].*got \[2\]"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base, h1, h1_offset=off.repeat(2), config=cfg
        )
    with pytest.raises(
        ValueError,
        match=r"h1 must be a 1-D bf16 base tensor when h1_offset is given .*got shape \[32, 32\]",
    ):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, h1, h1.clone(), h1_offset=off)
    with pytest.raises(TypeError, match=r"h1 must have dtype bfloat16, got torch.float32"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base.float(), h1, h1_offset=off, config=cfg
        )
    with pytest.raises(ValueError, match=r"h1 must start at a 16-byte aligned address"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, base[1:], h1, h1_offset=off, config=cfg)
    with pytest.raises(ValueError, match=r"h1_offset must be on the same device as grad_h3_ptrs"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base, h1, h1_offset=off.to("meta"), config=cfg
        )
    # With h1_offset the base may hold the grad_h1 rows (in place: not checkable on the host).
    w2_dgrad_swiglu_bwd(
        ptrs,
        offsets,
        row_offsets,
        w2,
        base,
        base[8:].view(rows, 2 * ffn),
        h1_offset=off,
        config=cfg,
    )

    # x_offset
    grad_w13 = torch.zeros(2, 2, ffn, hidden, device=DEVICE)
    x_base = torch.zeros(8 + rows * hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match=r"x_offset must have dtype int64, got torch.float32"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off.float())
    with pytest.raises(
        ValueError,
        match=r"x_gathered must be a 1-D bf16 base tensor when x_offset is given .*\[32, 32\]",
    ):
        w13_wgrad(h1, grad_h3, offsets, row_offsets, grad_w13, x_offset=off)
    with pytest.raises(ValueError, match=r"x_gathered must have shape \[32, 32\] \[R_act, D\]"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13)
    with pytest.raises(ValueError, match=r"x_gathered must start at a 16-byte aligned address"):
        w13_wgrad(h1, x_base[3:], offsets, row_offsets, grad_w13, x_offset=off)
    # x_rows (a row address table; checked before any launch)
    table = torch.zeros(64, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"x_rows needs x_offset .*got x_offset=None"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_rows=table)
    with pytest.raises(TypeError, match=r"x_rows must have dtype int64, got torch.int32"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off,
                  x_rows=table.int())
    with pytest.raises(ValueError, match=r"rows_origin must be a non-negative int, a multiple "
                                         r"of 16 .*got 8"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off, x_rows=table,
                  rows_origin=8)
    with pytest.raises(ValueError, match=r"x_offset must have shape \[2\] \[2\] with x_rows"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off, x_rows=table,
                  rows_origin=16)
    with pytest.raises(ValueError, match=r"rows_origin is read only with x_rows, got 16"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off, rows_origin=16)

    # h3_addr
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    grad_y = torch.zeros(4, hidden, dtype=torch.bfloat16, device=DEVICE)
    scores = torch.zeros(4, 2, device=DEVICE)
    routes = torch.zeros(8, hidden, dtype=torch.bfloat16, device=DEVICE)
    grad_scores = torch.zeros(4, 2, device=DEVICE)
    addr = torch.tensor([routes.data_ptr()], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"h3_routes must be None when h3_addr is given"):
        route_grads(grad_y, routes, ids, scores, routes.clone(), grad_scores, h3_addr=addr)
    with pytest.raises(TypeError, match=r"h3_routes must be a torch.Tensor when h3_addr is not"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores)
    with pytest.raises(TypeError, match=r"h3_addr must have dtype int64, got torch.int32"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores, h3_addr=addr.int())
    with pytest.raises(ValueError, match=r"h3_addr must have shape \[1\].*got \[1, 1\]"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores, h3_addr=addr[None])
    with pytest.raises(ValueError, match=r"h3_addr must be on the same device as grad_y"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores, h3_addr=addr.to("meta"))
    with pytest.raises(
        ValueError, match=r"h3_routes and grad_routes_out must be disjoint or start at the same row"
    ):
        nine = torch.zeros(9, hidden, dtype=torch.bfloat16, device=DEVICE)
        route_grads(grad_y, nine[1:], ids, scores, nine[:-1], grad_scores)  # one row apart


# --------------------------------------------------------------------------------------------
# The persistent Gluon WGRAD (Hopper only)
# --------------------------------------------------------------------------------------------


def _gluon_configs():
    from distmoe.kernels.wgrad_gluon import GLUON_WGRAD_CONFIGS

    return GLUON_WGRAD_CONFIGS


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["main", "ws", "pp"])
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("kind", ["W2", "W13_x_offset", "W2_p_tail"])
@pytest.mark.parametrize("cfg", _gluon_configs(), ids=lambda c: "x".join(map(str, c)))
def test_gluon_wgrad(cfg, kind, programs, form):
    """The Gluon kernel (bf16 out, overwrite) over a NaN-poisoned output against the fp64-exact
    sum of the same bf16 products: each element within one bf16 rounding (2^-8 relative) plus
    fp32 accumulation on both sides (2 * rows * 2^-24 of the magnitude sum). Row counts: an
    empty expert (zeros), fewer rows than one step, whole steps, partial last steps (ending
    inside a 16-row slice, and on a slice boundary: 48); the rows after each small expert
    are scaled by 2^10 and the spare rows are NaN, so a partial step that reads past its
    expert's end shows. With 3 programs every program walks several tiles (the load
    stream crosses tile boundaries, empty tiles included). W13's x sits at a device offset
    (descriptor built on the device). P not a multiple of ``block_p`` (``W2_p_tail``: D =
    320, 64 rows past the last whole 128- or 256-row block; W13 with 256-row blocks: 2F =
    384): each expert's last row block is stored clipped, and the NaN-poisoned output shows
    a store past an expert's rows (the next expert's first rows would be overwritten).
    ``form``: the plain kernel, the warp-specialised one ("ws"), or its ping-pong form
    ("pp", configs of 4 warps and 128 rows: also the same bits as "ws" with two cooperating
    warpgroups)."""
    from distmoe.kernels.wgrad_gluon import gluon_wgrad_supported, launch_gluon_wgrad

    block_p, block_q, stages, warps, block_k = cfg
    specialized, pingpong = form != "main", form == "pp"
    if specialized and block_q > 128:
        pytest.skip("the warp-specialised kernel takes block_q <= 128")
    if pingpong and (warps != 4 or block_p != 128):
        pytest.skip("the ping-pong form takes warpgroups of 4 warps over 128 rows")
    counts = [0, 37, 64, 200, 1, 128, 301, 0, 75, 48]
    layout = layout_from_counts(counts, 128, idle_tiles=1)
    big = [e + 1 for e, c in enumerate(counts[:-1]) if 0 < c < 128]
    hidden, ffn = (320 if kind == "W2_p_tail" else 256), 192
    if kind.startswith("W2"):
        width_p, width_q = hidden, ffn  # Q below block_q: clipped columns
    else:
        width_p, width_q = 2 * ffn, hidden
    a = _wgrad_operand(layout, width_p, big_experts=big)
    b = _wgrad_operand(layout, width_q, big_experts=big)
    out = poisoned(len(counts), width_p, width_q)
    assert gluon_wgrad_supported(a, out, block_p, block_q) is None
    b_offset = None
    if kind == "W13_x_offset":
        offset = 8 * 5  # elements: 16-byte aligned, not a multiple of a row
        base = poisoned(offset + b.numel() + width_q)
        base[offset:offset + b.numel()] = b.reshape(-1)
        b_src, b_offset = base, torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    else:
        b_src = b
    launch_gluon_wgrad(a, b_src, layout.row_offsets, out, b_offset=b_offset, block_p=block_p,
                       block_q=block_q, stages=stages, num_warps=warps, block_k=block_k,
                       programs=programs, specialized=specialized, pingpong=pingpong)
    if pingpong:  # the same MMAs per tile as two cooperating warpgroups of the same kernel
        coop = poisoned(len(counts), width_p, width_q)
        launch_gluon_wgrad(a, b_src, layout.row_offsets, coop, b_offset=b_offset,
                           block_p=block_p, block_q=block_q, stages=stages, num_warps=8,
                           block_k=block_k, programs=programs, specialized=True)
        assert same_bits(coop, out)

    zeros = torch.zeros(len(counts), width_p, width_q, device=DEVICE)
    po, ro = layout.padded_offsets, layout.row_offsets
    expected = w2_wgrad_ref(a, b, po, ro, zeros.clone())
    magnitude = w2_wgrad_ref(a.abs(), b.abs(), po, ro, zeros.clone())
    got = out.float()
    assert torch.isfinite(got).all(), "an output element was not written (NaN poison left)"
    # fp32 sums of up to max(counts) exact products on both sides, in different orders
    acc_bound = 2 * max(counts) * 2.0**-24 * magnitude
    excess = (got - expected).abs() - (ROUNDING_REL * expected.abs() + acc_bound)
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e}"
    for e, count in enumerate(counts):
        if count == 0:
            assert not got[e].any()  # an expert without rows: exact zeros
    # The Triton kernel on the same rows: the same row steps in the same order.
    triton_out = poisoned(len(counts), width_p, width_q)
    config = WgradConfig(block_k=64, block_out_m=block_p, block_out_n=block_q,
                         num_warps=warps, num_stages=3)
    if kind.startswith("W2"):
        w2_wgrad(a, b, po, ro, triton_out, accumulate=False, config=config)
    else:
        w13_wgrad(a, b_src, po, ro, triton_out.view(len(counts), 2, ffn, hidden),
                  x_offset=b_offset, accumulate=False, config=config)
    diff = (got - triton_out.float()).abs().max().item()
    assert diff <= ROUNDING_REL * triton_out.float().abs().max().item(), diff
    # Through the public entry point with gluon=True: the same bits as the direct launch
    # (one program per SM here, so a different tile walk, same per-tile sums).
    via = poisoned(len(counts), width_p, width_q)
    gconfig = WgradConfig(block_k=block_k, block_out_m=block_p, block_out_n=block_q,
                          num_warps=warps, num_stages=stages, gluon=True)
    if kind.startswith("W2"):
        w2_wgrad(a, b, po, ro, via, accumulate=False, config=gconfig)
    else:
        w13_wgrad(a, b_src, po, ro, via.view(len(counts), 2, ffn, hidden),
                  x_offset=b_offset, accumulate=False, config=gconfig)
    assert same_bits(via, out)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "pp"])
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("cfg", _gluon_configs(), ids=lambda c: "x".join(map(str, c)))
def test_gluon_wgrad_x_rows(cfg, programs, form):
    """The warp-specialised Gluon W13 WGRAD reading x's rows in place through the gather
    table (``cp.async`` by address: :func:`kept_x_rows`'s null rows, NaN behind padding
    addresses and around x) gives the same bits as the same kernel over the rows stored in
    order (TMA), and so does the public entry point (one program per SM)."""
    from distmoe.kernels.wgrad_gluon import launch_gluon_wgrad

    block_p, block_q, stages, warps, block_k = cfg
    pingpong = form == "pp"
    if block_q > 128:
        pytest.skip("the warp-specialised kernel takes block_q <= 128")
    if pingpong and (warps != 4 or block_p != 128):
        pytest.skip("the ping-pong form takes warpgroups of 4 warps over 128 rows")
    counts = [0, 37, 64, 200, 1, 128, 301, 0, 75, 48]
    layout = layout_from_counts(counts, 128, idle_tiles=1)
    big = [e + 1 for e, c in enumerate(counts[:-1]) if 0 < c < 128]
    hidden, ffn = 256, 256  # P = 512: 256-row tiles too (the heuristic's pick here)
    width_p, width_q = 2 * ffn, hidden
    a = _wgrad_operand(layout, width_p, big_experts=big)
    base, x_offset, table, origin, x_gathered, _keep = kept_x_rows(layout, hidden)
    po, ro = layout.padded_offsets, layout.row_offsets
    opts = dict(block_p=block_p, block_q=block_q, stages=stages, num_warps=warps,
                block_k=block_k, programs=programs, specialized=True, pingpong=pingpong)
    want = poisoned(len(counts), width_p, width_q)
    launch_gluon_wgrad(a, x_gathered, ro, want, **opts)
    got = poisoned(len(counts), width_p, width_q)
    launch_gluon_wgrad(a, base, ro, got, b_offset=x_offset, b_rows=table, padded_offsets=po,
                       b_rows_origin=origin, **opts)
    assert torch.isfinite(got).all(), "an output element was not written (NaN poison left)"
    assert same_bits(got, want)
    # rows stored in order, the switch set: the (null) table unread, the same bits
    ordered_base, ordered_offset = in_order_rows(x_gathered, origin)  # NaN past the live rows
    ordered = poisoned(len(counts), width_p, width_q)
    launch_gluon_wgrad(a, ordered_base, ro, ordered, b_offset=ordered_offset,
                       b_rows=torch.zeros_like(table), padded_offsets=po, b_rows_origin=origin,
                       **opts)
    assert same_bits(ordered, want)
    zeros = torch.zeros(len(counts), width_p, width_q, device=DEVICE)
    expected = w2_wgrad_ref(a, x_gathered, po, ro, zeros.clone())
    magnitude = w2_wgrad_ref(a.abs(), x_gathered.abs(), po, ro, zeros)
    excess = (got.float() - expected).abs() - (ROUNDING_REL * expected.abs()
                                               + 2 * max(counts) * 2.0**-24 * magnitude)
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e}"
    via = poisoned(len(counts), width_p, width_q)
    gconfig = WgradConfig(block_k=block_k, block_out_m=block_p, block_out_n=block_q,
                          num_warps=warps, num_stages=stages, gluon=True, specialized=True,
                          pingpong=pingpong)
    w13_wgrad(a, base, po, ro, via.view(len(counts), 2, ffn, hidden), x_offset=x_offset,
              accumulate=False, config=gconfig, x_rows=table, rows_origin=origin)
    assert same_bits(via, want)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("kind", ["W2_p_tail", "W13_x_offset"])
@pytest.mark.parametrize("form", ["wide", "pp"])
def test_gluon_wgrad_lockstep(form, kind, programs):
    """The warp-specialised WGRAD with its producers in lockstep (``lockstep=True``: each
    waits for the previous wave's loads, counted in a device counter) writes the same bits as
    without, over a NaN-poisoned output: an expert with no rows, partial steps and a partial
    last row block (P = 320), W13's B at a device offset; with 3 programs each walks many
    tiles, so a counter that never reaches a wave's need would stall (the wait is bounded)
    or mis-order nothing the bits would show. Through ``w2_wgrad`` with
    ``WgradConfig(lockstep=True)`` too. A launch with B's rows from a table refuses it."""
    from distmoe.kernels.wgrad_gluon import launch_gluon_wgrad

    block_p, warps, stages = (256, 8, 3) if form == "wide" else (128, 4, 5)
    counts = [0, 37, 64, 200, 1, 128, 301, 0, 75, 48]
    layout = layout_from_counts(counts, 128, idle_tiles=1)
    width_p, width_q = (320, 192) if kind == "W2_p_tail" else (384, 256)
    big = [e + 1 for e, c in enumerate(counts[:-1]) if 0 < c < 128]
    a = _wgrad_operand(layout, width_p, big_experts=big)
    b = _wgrad_operand(layout, width_q, big_experts=big)
    b_src, b_offset = b, None
    if kind == "W13_x_offset":
        offset = 8 * 5
        b_src = poisoned(offset + b.numel() + width_q)
        b_src[offset:offset + b.numel()] = b.reshape(-1)
        b_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    outs = []
    for lockstep in (False, True):
        out = poisoned(len(counts), width_p, width_q)
        launch_gluon_wgrad(a, b_src, layout.row_offsets, out, b_offset=b_offset,
                           block_p=block_p, block_q=128, stages=stages, num_warps=warps,
                           programs=programs, specialized=True, pingpong=form == "pp",
                           lockstep=lockstep)
        outs.append(out)
    assert torch.isfinite(outs[1].float()).all(), "an output element was not written"
    assert same_bits(outs[0], outs[1])
    if kind == "W2_p_tail":
        via = poisoned(len(counts), width_p, width_q)
        w2_wgrad(a, b, layout.padded_offsets, layout.row_offsets, via, accumulate=False,
                 config=WgradConfig(block_out_m=block_p, block_out_n=128, num_warps=warps,
                                    num_stages=stages, gluon=True, specialized=True,
                                    pingpong=form == "pp", lockstep=True))
        assert same_bits(via, outs[0])
    table = torch.zeros(int(layout.padded_offsets[-1]), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"lockstep needs specialized=True and B loaded by TMA "
                                         r"\(no b_rows\), got specialized=True and a b_rows"):
        launch_gluon_wgrad(a, b_src, layout.row_offsets, outs[0], block_p=block_p,
                           block_q=128, stages=stages, num_warps=warps, specialized=True,
                           b_rows=table, lockstep=True)


def test_gluon_wgrad_config_rules():
    # B's rows by address (x_rows): 256-row output tiles where P allows, else the usual pick
    got = WgradConfig.hopper_gluon(out_rows=1536, out_cols=2048, rows_per_expert=256,
                                   gathered_b=True)
    assert (got.block_out_m, got.block_out_n, got.num_warps, got.num_stages, got.specialized,
            got.pingpong) == (256, 128, 8, 3, True, False)
    for rows in (256, 4096):
        assert WgradConfig.hopper_gluon(out_rows=384, out_cols=2048, rows_per_expert=rows,
                                        gathered_b=True) == WgradConfig.hopper_gluon(
            out_rows=384, out_cols=2048, rows_per_expert=rows)
    with pytest.raises(ValueError, match=r"gluon=True needs split_rows == 1 \(got 2\)"):
        WgradConfig(split_rows=2, gluon=True)
    with pytest.raises(ValueError, match=r"block_out_m >= 16 \* num_warps \(got 64 and 8"):
        WgradConfig(block_out_m=64, num_warps=8, gluon=True)
    with pytest.raises(TypeError, match=r"gluon must be a bool, got int"):
        WgradConfig(gluon=1)
    # the warp-specialised form: a Gluon config with at most 128 output columns
    with pytest.raises(TypeError, match=r"specialized must be a bool, got int"):
        WgradConfig(gluon=True, specialized=1)
    with pytest.raises(ValueError, match=r"specialized=True needs gluon=True \(got False\)"):
        WgradConfig(specialized=True)
    with pytest.raises(ValueError, match=r"block_out_n <= 128 \(got 256\)"):
        WgradConfig(block_out_n=256, gluon=True, specialized=True)
    # its ping-pong form: two warpgroups of 4 warps, each on a whole 128-row tile
    with pytest.raises(TypeError, match=r"pingpong must be a bool, got int"):
        WgradConfig(gluon=True, specialized=True, num_warps=4, pingpong=1)
    with pytest.raises(ValueError, match=r"pingpong=True needs specialized=True \(got False\)"):
        WgradConfig(gluon=True, num_warps=4, pingpong=True)
    with pytest.raises(ValueError, match=r"num_warps == 4 \(got 8\)"):
        WgradConfig(gluon=True, specialized=True, pingpong=True)
    with pytest.raises(ValueError, match=r"block_out_m == 128 \(got 64\)"):
        WgradConfig(block_out_m=64, gluon=True, specialized=True, num_warps=4, pingpong=True)
    # the producers in lockstep: the warp-specialised form's, off unless asked for
    with pytest.raises(TypeError, match=r"lockstep must be a bool, got int"):
        WgradConfig(gluon=True, specialized=True, lockstep=1)
    with pytest.raises(ValueError, match=r"lockstep=True needs specialized=True \(got False\)"):
        WgradConfig(gluon=True, lockstep=True)
    # the heuristic turns it on for the 256 x 128 tiles from 48 MiB an expert (DeepSeek-V3's
    # W13: 56 MiB; not its W2's 28, nor V4-Flash's or GPT-OSS-120B's 32), B loaded by TMA
    from distmoe.kernels._common import WGRAD_LOCKSTEP_EXPERT_BYTES

    assert WGRAD_LOCKSTEP_EXPERT_BYTES == 2 * 4096 * 6144
    for (rows, cols), on in {(4096, 7168): True, (4096, 6144): True, (4096, 6016): False,
                             (7168, 2048): False, (4096, 4096): False, (5760, 2880): False,
                             (8192, 3072): True}.items():
        got = WgradConfig.hopper_gluon(out_rows=rows, out_cols=cols, rows_per_expert=128)
        assert (got.block_out_m, got.lockstep) == (256, on), (rows, cols)
        gathered = WgradConfig.hopper_gluon(out_rows=rows, out_cols=cols, rows_per_expert=128,
                                            gathered_b=True)
        assert not gathered.lockstep, (rows, cols)
    # what the Hopper heuristic picks, always the specialised kernel's 128-column tile: 256
    # output rows (8 warps, 3 stages) where an expert's gradient holds >= 12 MiB, at any row
    # count; else its ping-pong form below 1024 rows per expert or for narrow outputs, its two
    # cooperating warpgroups (8 warps, 5 stages) from 1024 rows per expert with outputs >= 256
    # wide
    pick = WgradConfig.hopper_gluon

    def form(c):
        return (c.block_out_m, c.block_out_n, c.gluon, c.specialized, c.pingpong, c.num_warps,
                c.num_stages)

    pingpong, cooperative = (128, 128, True, True, True, 4, 5), (128, 128, True, True, False, 8, 5)
    wide = (256, 128, True, True, False, 8, 3)
    assert form(pick(out_rows=2048, out_cols=768, rows_per_expert=256)) == pingpong  # 3 MiB
    assert form(pick(out_rows=2048, out_cols=768, rows_per_expert=1023)) == pingpong
    assert form(pick(out_rows=2048, out_cols=128, rows_per_expert=2048)) == pingpong
    assert form(pick(out_rows=1536, out_cols=2048, rows_per_expert=1024)) == cooperative  # 6 MiB
    assert form(pick(out_rows=2048, out_cols=2048, rows_per_expert=2048)) == cooperative  # 8 MiB
    for rows in (96, 128, 1024, 2048, None):  # 16 MiB: T=8192 D=4096 F=2048 E=32's W2
        assert form(pick(out_rows=4096, out_cols=2048, rows_per_expert=rows)) == wide
    assert form(pick(out_rows=4096, out_cols=7168, rows_per_expert=128)) == wide  # DeepSeek-V3
    # the 12 MiB line, and the tile's 256 rows and 128 columns
    assert form(pick(out_rows=3072, out_cols=2048, rows_per_expert=128)) == wide
    assert form(pick(out_rows=3064, out_cols=2048, rows_per_expert=128)) == pingpong
    assert form(pick(out_rows=248, out_cols=32768, rows_per_expert=128)) == pingpong
    assert form(pick(out_rows=65536, out_cols=96, rows_per_expert=128)) == pingpong
    # P not a multiple of the tile (GPT-OSS: D = 2880, 15.8 MiB per expert): the same picks,
    # the last row block stored clipped; below 128 rows or off TMA's 16-byte pitch, the
    # Triton kernel
    assert form(pick(out_rows=2880, out_cols=2880, rows_per_expert=128)) == wide
    assert form(pick(out_rows=4000, out_cols=2048, rows_per_expert=2048)) == wide
    assert form(pick(out_rows=2000, out_cols=2048, rows_per_expert=2048)) == cooperative
    # an HBM3e-class device (H200: 140.4 GiB as torch reports it; H100: 79.6): the 256 x 128
    # tiles from 1024 rows per expert only, ping-pong below (and no lockstep); a device of
    # unknown memory or no row hint keeps the H100's rule
    from distmoe.kernels._common import HBM3E_MEMORY_BYTES, device_memory_bytes

    h200, h100 = 143771 * 2**20, 81559 * 2**20
    assert h100 < HBM3E_MEMORY_BYTES <= h200
    for rows, cols in ((4096, 7168), (7168, 2048), (5760, 2880), (4096, 4096)):
        for hint, want in ((96, pingpong), (128, pingpong), (1023, pingpong), (1024, wide),
                           (2048, wide), (None, wide)):
            got = pick(out_rows=rows, out_cols=cols, rows_per_expert=hint, device_memory=h200)
            assert form(got) == want, (rows, cols, hint)
            assert not got.lockstep or hint is None or hint >= 1024, (rows, cols, hint)
            assert pick(out_rows=rows, out_cols=cols, rows_per_expert=hint,
                        device_memory=h100) == pick(out_rows=rows, out_cols=cols,
                                                    rows_per_expert=hint), (rows, cols, hint)
    assert pick(out_rows=4096, out_cols=7168, rows_per_expert=1024, device_memory=h200).lockstep
    # below 12 MiB the device changes nothing
    for hint in (128, 2048):
        assert pick(out_rows=2048, out_cols=2048, rows_per_expert=hint, device_memory=h200) \
            == pick(out_rows=2048, out_cols=2048, rows_per_expert=hint)
    # the heuristic reads the device's memory from the driver; no device, a CPU one: unknown
    assert device_memory_bytes(None) is None and device_memory_bytes("cpu") is None
    if torch.cuda.is_available():
        assert device_memory_bytes("cuda") == torch.cuda.get_device_properties(0).total_memory
        from distmoe.kernels._common import gluon_device

        if gluon_device("cuda"):  # on a Hopper GPU the heuristic keys on its memory
            assert WgradConfig.from_heuristic(
                out_rows=4096, out_cols=7168, rows_per_expert=128,
                device=torch.device("cuda")) == pick(
                out_rows=4096, out_cols=7168, rows_per_expert=128,
                device_memory=device_memory_bytes("cuda"))
    assert pick(out_rows=4004, out_cols=2048, rows_per_expert=2048) is None
    assert pick(out_rows=120, out_cols=2048, rows_per_expert=2048) is None
    # through the device heuristic the same picks; without a Hopper device, Triton's
    assert WgradConfig.from_heuristic(out_rows=4096, out_cols=2048, rows_per_expert=128) \
        == WgradConfig.from_heuristic(out_rows=4096, out_cols=2048, rows_per_expert=128,
                                      device="cpu")
    assert not WgradConfig.from_heuristic(out_rows=4096, out_cols=2048,
                                          rows_per_expert=128).gluon


def _gluon_dgrad_problem(hidden, ffn, block, scale=1):
    """The Gluon W2 DGRAD tests' rows: experts with no rows, one row, partial and whole tiles,
    a whole tile of padding rows, an idle tile, a null live row (expert 2; its grad_h3 row
    zeros, its h1 row NaN: never read); spare rows NaN. ``scale`` multiplies every expert's
    rows. Returns (layout, live, w2, rows, h1, null_rows, null_act)."""
    counts = [scale * n for n in (0, 37, 128, 300, 1, 129, 0, 75)]
    layout = layout_from_counts(counts, block, idle_tiles=1, extra_tiles={2: 1})
    num_experts, num_act = len(counts), layout.num_act
    live = layout.live_act()
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    rows = torch.randn(num_act, hidden, device=DEVICE).bfloat16()
    rows[~live] = float("nan")  # spare rows: their products are never stored
    h1 = torch.randn(num_act, 2 * ffn, device=DEVICE).bfloat16() * 2
    h1[~live] = float("nan")
    null_rows = torch.zeros(layout.num_rows, dtype=torch.bool)
    null_rows[layout.is_live.nonzero()[40]] = True
    null_act = layout.act_of_row[null_rows].to(DEVICE)
    rows[null_act] = 0.0  # what a push leaves there: zeros (finite at least)
    h1[null_act] = float("nan")
    return layout, live, w2, rows, h1, null_rows, null_act


def _assert_one_rounding_apart(got, want, live, null_act, *, spare_poisoned=True):
    """Gluon against Triton: live rows within one bf16 rounding of each other (the kernels
    compute the sigmoid differently), null rows exact zeros, spare rows still poison."""
    g, w = got[live].double(), want[live].double()
    assert torch.isfinite(g).all()
    scale = w.abs().max().item()
    assert ((g - w).abs() <= 2.0**-7 * w.abs() + 1e-3 * scale).all(), (g - w).abs().max().item()
    assert (got[null_act] == 0).all()
    if spare_poisoned:
        assert same_bits(got[~live], poisoned(int((~live).sum()), got.shape[1]))


def _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1, out, h2, *, h1_offset=None,
                              scored_rows=False, **launch):
    """One W2 DGRAD on the pre-gathered ``rows``: the Gluon kernel launched directly
    (``launch``: its ring depth, its grid) or, as the reference, the Triton kernel at
    128 x 128 x 64 tiles; then a device synchronisation."""
    from distmoe.kernels.w2_dgrad_gluon import launch_gluon_w2_dgrad

    if gluon:
        launch_gluon_w2_dgrad(ptrs, po, ro, w2, rows, h1, out, h1_offset=h1_offset, h2_out=h2,
                              scored_rows=scored_rows, **launch)
    else:
        cfg = W2DgradConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
        w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, h1_offset=h1_offset, h2_out=h2,
                            grad_h3_rows=rows, scored_rows=scored_rows, config=cfg)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("stages", [4, 6])
@pytest.mark.parametrize("h1_mode", ["plain", "offset_in_place"])
def test_gluon_w2_dgrad(programs, stages, h1_mode):
    """The warp-specialised Gluon W2 DGRAD against the Triton kernel on the same pre-gathered
    rows: experts with no rows, one row, partial and whole tiles, a whole tile of padding rows,
    an idle tile, a null live row; 3 programs walk many tiles each (both consumers take turns
    many times; the ring's phases wrap). grad_h1 and h2 agree within one bf16 rounding of each
    other (the two kernels compute the sigmoid differently); null rows get exact zeros; spare
    rows past the live end keep their poison."""
    from distmoe.kernels.w2_dgrad_gluon import gluon_w2_dgrad_reason

    hidden, ffn, block = 256, 384, 128
    assert gluon_w2_dgrad_reason(DEVICE, hidden=hidden, ffn=ffn, block_m=block,
                                 block_n=128, block_k=64) is None
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block)
    num_act = layout.num_act
    ptrs = row_table(layout, rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets

    def run(gluon):
        h2 = poisoned(num_act, ffn)
        if h1_mode == "plain":
            h1_arg, out, h1_offset = h1, poisoned(num_act, 2 * ffn), None
        else:
            offset = 8 * 3  # elements: 16-byte aligned, not a multiple of a row
            h1_arg = poisoned(offset + h1.numel() + 16)
            h1_arg[offset:offset + h1.numel()] = h1.reshape(-1)
            out = h1_arg[offset:offset + h1.numel()].view(num_act, 2 * ffn)  # in place
            h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
        _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1_arg, out, h2,
                                  h1_offset=h1_offset, stages=stages, programs=programs)
        return out.clone(), h2

    want_h1, want_h2 = run(False)
    got_h1, got_h2 = run(True)
    for got, want in ((got_h1, want_h1), (got_h2, want_h2)):
        _assert_one_rounding_apart(got, want, live, null_act,
                                   spare_poisoned=h1_mode == "plain" or got is got_h2)
    # through the launcher: config.gluon picks the Gluon kernel (same bits as the direct call)
    cfg = W2DgradConfig(block_m=block, block_n=128, block_k=64, num_stages=stages, gluon=True)
    out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
    w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, h2_out=h2, grad_h3_rows=rows, config=cfg)
    if h1_mode == "plain":
        assert same_bits(out, got_h1) and same_bits(h2, got_h2)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["pingpong", "split"])
@pytest.mark.parametrize("scored", [False, True], ids=["plain", "scored"])
def test_gluon_w2_dgrad_partial_column_tile(split, scored):
    """F = 320, not a multiple of the 128-column tiles (as GPT-OSS's 2880): each row's last
    tile is partial (its weight columns past F TMA zeros, its quarters past F loading and
    storing nothing). Against the Triton kernel at the same tiles: grad_h1 and h2 within one
    bf16 rounding, null rows zeros, spare rows poisoned (a store past F lands in the row's
    u half or the next row, which the comparison shows); scored, the three score parts (the
    last over 64 columns) within 2^-8 of the largest. Ping-pong and split kernels, 3
    programs."""
    hidden, ffn, block = 256, 320, 128
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block)
    num_act = layout.num_act
    route_rows, before = _scored_route_rows(layout, hidden)
    ptrs = row_table(layout, route_rows if scored else rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets
    launch = {"epilogue_warps": 8} if split else {}

    def run(gluon):
        route_rows.copy_(before)
        out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1, out, h2,
                                  scored_rows=scored, programs=3, **launch)
        return out, h2, route_rows.clone()

    want = run(False)
    got = run(True)
    for g, w in zip(got[:2], want[:2], strict=True):
        _assert_one_rounding_apart(g, w, live, null_act)
    if scored:
        route = layout.route_of_act.to(DEVICE)
        has_part = live.clone()
        has_part[null_act] = False
        got_p, want_p = (r.view(torch.float32)[route[has_part]][:, 1:4] for r in (got[2],
                                                                              want[2]))
        assert torch.isfinite(got_p).all() and want_p[:, 2].abs().max() > 0
        assert ((got_p - want_p).abs() <= 2.0**-8 * want_p.abs().max()).all()


def test_gluon_w2_dgrad_partial_tile_refuses_prefetch_and_early_h1():
    """The h1 prefetch and the split kernel's early h1 loads take whole column tiles only: a
    ValueError naming both and F, before anything is launched."""
    from distmoe.kernels.w2_dgrad_gluon import launch_gluon_w2_dgrad

    some = torch.zeros(1)
    w2 = torch.zeros(2, 256, 320, dtype=torch.bfloat16)
    for opts in ({"h1_prefetch": 1}, {"epilogue_warps": 8, "epilogue_early_h1": True}):
        with pytest.raises(ValueError, match=r"h1_prefetch \(\d\) and epilogue_early_h1 "
                                             r"\((True|False)\) need F a multiple of 128 "
                                             r"\(whole column tiles\), got F = 320"):
            launch_gluon_w2_dgrad(some, some, some, w2, some, some, some, h1_offset=None,
                                  h2_out=None, **opts)


def _scored_route_rows(layout, hidden):
    """Poisoned bf16 route rows ``[routes, hidden]`` of ``layout``, each with its score (in
    [0.25, 1.25)) as the fp32 at its start, as the scored W2 DGRAD reads them; and a copy."""
    n_routes = int(layout.route_of_row.max()) + 1
    route_rows = poisoned(n_routes, hidden)
    route_rows.view(torch.float32)[:, 0] = torch.rand(n_routes, device=DEVICE) + 0.25
    return route_rows, route_rows.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("reload", [None, True], ids=["bounds_default", "bounds_reloaded"])
def test_gluon_w2_dgrad_scored(programs, reload):
    """scored_rows in the Gluon W2 DGRAD against the Triton kernel (same contract): grad_h1
    and h2 within one bf16 rounding of each other, the score parts within 2^-8 of the
    largest, written only after the scores of live non-null routes; nothing else of the
    route rows changes. ``reload``: the consumers load the per-expert bounds per tile (the
    default above 32 experts; this problem has fewer)."""
    hidden, ffn, block = 256, 384, 128
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block)
    num_act = layout.num_act
    route_rows, before = _scored_route_rows(layout, hidden)
    ptrs = row_table(layout, route_rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets

    def run(gluon):
        route_rows.copy_(before)
        out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        launch = {} if reload is None else {"reload_bounds": reload}
        _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1, out, h2,
                                  scored_rows=True, programs=programs, **launch)
        return out, h2, route_rows.clone()

    want_h1, want_h2, want_rows = run(False)
    got_h1, got_h2, got_rows = run(True)
    for got, want in ((got_h1, want_h1), (got_h2, want_h2)):
        _assert_one_rounding_apart(got, want, live, null_act)
    parts = ffn // 128
    route = layout.route_of_act.to(DEVICE)
    has_part = live.clone()
    has_part[null_act] = False
    got_p = got_rows.view(torch.float32)[route[has_part]][:, 1:1 + parts]
    want_p = want_rows.view(torch.float32)[route[has_part]][:, 1:1 + parts]
    assert torch.isfinite(got_p).all()
    assert ((got_p - want_p).abs() <= 2.0**-8 * want_p.abs().max()).all()
    expected = before.view(torch.float32).clone()
    expected[route[has_part], 1:1 + parts] = got_p
    assert same_bits(got_rows.view(torch.float32), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("stages,prefetch", [(5, 1), (4, 2), (3, 3), (2, 4)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("form", ["scored", "offset_in_place"])
def test_gluon_w2_dgrad_h1_prefetch(stages, prefetch, form):
    """h1 brought into shared memory by cp.async (``h1_prefetch`` slots per consumer, the
    slots refilled within the epilogue below 4) gives the same bits as the kernel's global
    loads (slots reused across tiles by both consumers)."""
    _same_bits_as_the_ping_pong_kernel(form, dict(num_stages=stages, h1_prefetch=prefetch))


@pytest.mark.gpu
@pytest.mark.parametrize("warps,buffers,stages,early",
                         [(4, 1, 5, False), (8, 1, 5, False), (8, 1, 4, False),
                          (8, 2, 3, False), (8, 1, 4, True), (4, 2, 3, True)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("form", ["scored", "offset_in_place"])
def test_gluon_w2_dgrad_split_epilogue(warps, buffers, stages, early, form):
    """The split kernel (one MMA warpgroup handing each fp32 tile to an epilogue partition of
    ``epilogue_warps`` warps through ``epilogue_buffers`` shared-memory tiles; ``early``: h1
    loaded a quarter ahead) gives the same bits as the ping-pong kernel; 3 programs walk many
    tiles, so each buffer is reused and its barriers change phase many times."""
    _same_bits_as_the_ping_pong_kernel(form, dict(num_stages=stages, epilogue_warps=warps,
                                                  epilogue_buffers=buffers,
                                                  epilogue_early_h1=early))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["pingpong", "split"])
@pytest.mark.parametrize("programs", [3, None, "twice_the_sms"])
def test_gluon_w2_dgrad_lockstep(split, programs):
    """``W2DgradConfig.lockstep`` (the TMA producer waits on a device counter for the wave
    before each tile) gives the ping-pong kernel's bits without it, scored, in both kernels:
    few programs walking many tiles (the last wave's idle programs must not hold the others'
    waits), one per SM, and twice as many programs as SMs asked for over ten times the rows
    (the grid is capped at the 171 tiles, still above an H100's or H200's 132 SMs at one
    program per SM: the programs not resident at first make the others' waits miss their
    bound, after which each stops waiting)."""
    from distmoe.kernels._common import num_sms

    scale = 1
    if programs == "twice_the_sms":
        programs, scale = 2 * num_sms(DEVICE), 10
    fields = dict(num_stages=4, lockstep=True, **({"epilogue_warps": 8} if split else {}))
    _same_bits_as_the_ping_pong_kernel("scored", fields, programs=programs, scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["pingpong", "split"])
@pytest.mark.parametrize("lockstep", [False, True], ids=["free", "lockstep"])
@pytest.mark.parametrize("programs", [1, 3, None])
def test_gluon_w2_dgrad_expert_groups(split, lockstep, programs):
    """``W2DgradConfig.expert_groups`` (each expert's tiles walked column tile by column tile
    over its row blocks, one to five of them here with every expert's rows doubled) gives
    the ping-pong kernel's bits in group-M order, scored, in both kernels, free and in
    lockstep: one and three programs walking many tiles, one per SM. A tile missed or
    taken twice leaves poison or a wrong row."""
    fields = dict(num_stages=4, expert_groups=True, lockstep=lockstep,
                  **({"epilogue_warps": 8} if split else {}))
    _same_bits_as_the_ping_pong_kernel("scored", fields, programs=programs, scale=2)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None])
def test_gluon_w2_dgrad_expert_groups_many_blocks(programs):
    """The expert-group order in the form the heuristic picks at 513 to 768 rows per expert
    (split epilogue, no lockstep), every expert's rows tripled: one, two, four and eight
    128-row blocks per expert (the largest, 900 rows, past the six blocks of 768), the
    ping-pong kernel's bits, scored."""
    fields = dict(num_stages=4, expert_groups=True, epilogue_warps=8)
    _same_bits_as_the_ping_pong_kernel("scored", fields, programs=programs, scale=3)


def _same_bits_as_the_ping_pong_kernel(form, fields, *, programs=3, scale=1):
    """The Gluon W2 DGRAD with the config ``fields`` (a variant of the kernel) gives the
    ping-pong kernel's bits at 4 stages: grad_h1, h2 and, scored, the route rows' score parts;
    3 programs (or ``programs``; None: one per SM) walk many tiles, null rows give zeros,
    spare rows keep their poison. ``form``: ``scored`` (score parts written into the route
    rows) or ``offset_in_place`` (h1 at a device offset, grad_h1 written over it). Also
    through the launcher's config (scored). ``scale``: as :func:`_gluon_dgrad_problem`'s."""
    hidden, ffn, block = 256, 384, 128
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block,
                                                                           scale)
    num_act = layout.num_act
    route_rows, before = _scored_route_rows(layout, hidden)
    scored = form == "scored"
    ptrs = row_table(layout, route_rows if scored else rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets
    offset = 8 * 3  # elements: 16-byte aligned, not a multiple of a row

    def run(**launch):
        route_rows.copy_(before)
        h2 = poisoned(num_act, ffn)
        if scored:
            h1_arg, out, h1_offset = h1, poisoned(num_act, 2 * ffn), None
        else:
            h1_arg = poisoned(offset + h1.numel() + 16)
            h1_arg[offset:offset + h1.numel()] = h1.reshape(-1)
            out = h1_arg[offset:offset + h1.numel()].view(num_act, 2 * ffn)  # in place
            h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
        _gluon_or_reference_dgrad(True, ptrs, po, ro, w2, rows, h1_arg, out, h2,
                                  h1_offset=h1_offset, scored_rows=scored, programs=programs,
                                  **launch)
        return out.clone(), h2, route_rows.clone()

    want = run(stages=4)
    launch = {("stages" if k == "num_stages" else k): v for k, v in fields.items()}
    got = run(**launch)
    for g, w in zip(got, want, strict=True):
        assert same_bits(g, w)
    assert torch.isfinite(got[0][live]).all() and (got[0][null_act] == 0).all()
    if scored:  # the score parts were written (the comparison above is not of two no-ops)
        assert not same_bits(got[2], before)
    if scored:  # through the launcher: the config's fields reach the kernel
        cfg = W2DgradConfig(block_m=block, block_n=128, block_k=64, gluon=True, **fields)
        out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        route_rows.copy_(before)
        w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, h2_out=h2, grad_h3_rows=rows,
                            config=cfg, scored_rows=True)
        assert same_bits(out, got[0]) and same_bits(h2, got[1])
        assert same_bits(route_rows, got[2])


def test_w2_dgrad_h1_prefetch_config_rules():
    """h1_prefetch: an int in [0, 4], only with gluon, and ring + slots within 6 x 32 KiB."""
    base = dict(block_m=128, block_n=128, block_k=64, gluon=True)
    assert W2DgradConfig(**base, num_stages=4, h1_prefetch=2).h1_prefetch == 2
    with pytest.raises(ValueError, match=r"h1_prefetch \(5\) must be in \[0, 4\]"):
        W2DgradConfig(**base, num_stages=1, h1_prefetch=5)
    with pytest.raises(TypeError, match="h1_prefetch must be an int, got bool"):
        W2DgradConfig(**base, h1_prefetch=True)
    with pytest.raises(ValueError, match=r"h1_prefetch \(1\) needs gluon=True"):
        W2DgradConfig(block_m=128, block_n=128, block_k=64, h1_prefetch=1)
    with pytest.raises(ValueError, match=r"num_stages \+ h1_prefetch \(5 \+ 2\) must be at "
                                         "most 6"):
        W2DgradConfig(**base, num_stages=5, h1_prefetch=2)


def test_w2_dgrad_split_epilogue_config_rules():
    """epilogue_warps in (0, 4, 8), epilogue_buffers in (1, 2), only with gluon, not with
    h1_prefetch, and ring + fp32 tiles within 7 x 32 KiB."""
    base = dict(block_m=128, block_n=128, block_k=64, gluon=True)
    cfg = W2DgradConfig(**base, num_stages=3, epilogue_warps=8, epilogue_buffers=2)
    assert (cfg.epilogue_warps, cfg.epilogue_buffers) == (8, 2)
    with pytest.raises(ValueError, match=r"epilogue_warps \(6\) must be one of \(0, 4, 8\)"):
        W2DgradConfig(**base, epilogue_warps=6)
    with pytest.raises(ValueError, match=r"epilogue_buffers \(3\) must be one of \(1, 2\)"):
        W2DgradConfig(**base, num_stages=1, epilogue_warps=8, epilogue_buffers=3)
    with pytest.raises(TypeError, match="epilogue_warps must be an int, got bool"):
        W2DgradConfig(**base, epilogue_warps=True)
    with pytest.raises(ValueError, match=r"epilogue_warps \(8\) needs gluon=True"):
        W2DgradConfig(block_m=128, block_n=128, block_k=64, epilogue_warps=8)
    with pytest.raises(ValueError, match=r"epilogue_warps \(4\) and h1_prefetch \(1\) do "
                                         "not combine"):
        W2DgradConfig(**base, num_stages=4, epilogue_warps=4, h1_prefetch=1)
    with pytest.raises(ValueError, match=r"num_stages \+ 2 \* epilogue_buffers \(4 \+ 2 \* 2\) "
                                         "must be at most 7"):
        W2DgradConfig(**base, num_stages=4, epilogue_warps=8, epilogue_buffers=2)
    with pytest.raises(ValueError, match=r"num_stages \(1\) must be at least 2 with gluon"):
        W2DgradConfig(**base, num_stages=1)
    with pytest.raises(ValueError, match="epilogue_early_h1 needs epilogue_warps"):
        W2DgradConfig(**base, epilogue_early_h1=True)
    with pytest.raises(TypeError, match="epilogue_early_h1 must be a bool, got int"):
        W2DgradConfig(**base, epilogue_warps=8, epilogue_early_h1=1)
    with pytest.raises(TypeError, match="lockstep must be a bool, got int"):
        W2DgradConfig(**base, lockstep=1)
    with pytest.raises(TypeError, match="expert_groups must be a bool, got int"):
        W2DgradConfig(**base, expert_groups=1)


def test_gluon_w2_dgrad_config_reaches_the_launch(monkeypatch):
    """The W2 DGRAD config's Gluon fields (ring depth, group-M, split epilogue, lockstep,
    expert groups) reach the launch, on any machine: the launcher is a recorder and the check
    admits the case; nothing is written. ``gluon=False`` calls neither."""
    import distmoe.kernels.w2_dgrad_gluon as wg

    calls = []
    monkeypatch.setattr(wg, "gluon_w2_dgrad_reason",
                        lambda device, **kw: calls.append(("reason", kw)) and None)
    monkeypatch.setattr(wg, "launch_gluon_w2_dgrad",
                        lambda *a, **kw: calls.append(("launch", kw)))
    hidden, ffn, block = 256, 384, 128
    layout, _live, w2, rows, h1, null_rows, _null_act = _gluon_dgrad_problem(hidden, ffn,
                                                                             block)
    ptrs = row_table(layout, rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets
    out = poisoned(layout.num_act, 2 * ffn)
    base = dict(block_m=block, block_n=128, block_k=64, gluon=True)
    for fields in (dict(num_stages=4), dict(num_stages=5, group_m=16, epilogue_warps=8,
                                            lockstep=True), dict(num_stages=4,
                                                                 expert_groups=True)):
        calls.clear()
        w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, grad_h3_rows=rows,
                            config=W2DgradConfig(**base, **fields))
        (_, reason), (_, launch) = calls
        assert (reason["block_n"], reason["block_k"]) == (128, 64)
        assert (launch["stages"], launch["group_m"], launch["epilogue_warps"],
                launch["lockstep"], launch["expert_groups"]) == (
            fields["num_stages"], fields.get("group_m", 8), fields.get("epilogue_warps", 0),
            fields.get("lockstep", False), fields.get("expert_groups", False))
    assert same_bits(out, poisoned(layout.num_act, 2 * ffn))  # the recorder launched nothing
    calls.clear()
    w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, grad_h3_rows=rows,
                        config=W2DgradConfig(block_m=block, block_n=128, block_k=64))
    assert calls == []


def test_w2_dgrad_lockstep_rule():
    """The W2 DGRAD heuristic's lockstep rule (whatever the device): 96 to 191 rows per
    expert with the rank's W2 weights at least 3 GiB (run 53: DeepSeek-V3 and V4-Flash
    gained, GPT-OSS-120B's 2.1 GB was even, 0.4 GB lost); never without the expert count."""
    from distmoe.kernels._common import w2_dgrad_lockstep

    rule = lambda rows, e, d, f: w2_dgrad_lockstep(  # noqa: E731
        rows_per_expert=rows, num_experts=e, hidden=d, ffn=f)
    assert rule(128, 256, 7168, 2048) and rule(96, 256, 4096, 2048)  # 7.5 GB, 4 GiB
    assert rule(191, 256, 4096, 2048) and not rule(192, 256, 4096, 2048)
    assert not rule(95, 256, 4096, 2048) and not rule(256, 256, 7168, 2048)
    assert not rule(128, 128, 2880, 2880) and not rule(128, 128, 2048, 768)  # 2.1, 0.4 GB
    assert rule(128, 192, 4096, 2048) and not rule(128, 191, 4096, 2048)  # 3 GiB, under
    assert not rule(128, None, 7168, 2048)
    assert not rule(128, 32, 7168, 2048)  # DeepSeek-V3 at EP=8: 0.94 GB per rank


def test_w2_dgrad_expert_groups_rule(monkeypatch):
    """The W2 DGRAD heuristic's Gluon pick walks its tiles in expert-group order at 16 to 768
    rows per expert (runs 60-62: the kernel 1.8-11% faster there, even to 17% slower at 1024,
    12% slower at 2048), on any machine: the device check admits the case (nothing is launched)."""
    import distmoe.kernels.w2_dgrad_gluon as wg

    monkeypatch.setattr(wg, "gluon_w2_dgrad_reason", lambda device, **kw: None)
    pick = lambda rows: W2DgradConfig.from_heuristic(  # noqa: E731
        hidden=7168, ffn=2048, rows_per_expert=rows, device=torch.device("cpu"),
        num_experts=256)
    assert all(pick(rows).gluon for rows in (16, 64, 96, 128, 512, 1024))
    assert [pick(rows).expert_groups for rows in (8, 15, 16, 24, 64, 512, 768, 769, 1024)] \
        == [False, False, True, True, True, True, True, False, False]
    assert pick(128).lockstep and pick(128).expert_groups  # both at DeepSeek-V3 (run 60)


@pytest.mark.gpu
def test_gluon_w2_dgrad_heuristic():
    """On a Hopper GPU with the layer's hint the heuristic picks the Gluon kernel in its split
    form (8 epilogue warps, one fp32 tile buffer; 5 stages at >= 1024 rows per expert, 4
    below); widths it cannot tile keep the Triton config."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] != 9:
        pytest.skip("the Gluon W2 DGRAD is for compute capability 9.x")
    big = W2DgradConfig.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048, device=dev)
    small = W2DgradConfig.from_heuristic(hidden=2048, ffn=768, rows_per_expert=256, device=dev)
    assert (big.gluon, big.block_n, big.num_stages) == (True, 128, 5)
    assert (small.gluon, small.block_n, small.num_stages) == (True, 128, 4)
    for cfg in (big, small):
        assert (cfg.epilogue_warps, cfg.epilogue_buffers) == (8, 1)
    odd = W2DgradConfig.from_heuristic(hidden=4096, ffn=2000, rows_per_expert=2048, device=dev)
    assert not odd.gluon
    # F = 2880 (GPT-OSS): the split kernel, each row's last column tile partial
    tail = W2DgradConfig.from_heuristic(hidden=2880, ffn=2880, rows_per_expert=128, device=dev)
    assert (tail.gluon, tail.block_n, tail.epilogue_warps) == (True, 128, 8)
    # lockstep with the local expert count where the rule takes it (DeepSeek-V3), else off
    assert not any(c.lockstep for c in (big, small, tail))
    assert W2DgradConfig.from_heuristic(hidden=7168, ffn=2048, rows_per_expert=128, device=dev,
                                        num_experts=256).lockstep
    assert not W2DgradConfig.from_heuristic(hidden=2880, ffn=2880, rows_per_expert=128,
                                            device=dev, num_experts=128).lockstep
    # the expert-group tile order at 16 to 768 rows per expert (runs 60-62)
    groups = [W2DgradConfig.from_heuristic(hidden=2048, ffn=768, rows_per_expert=rows,
                                           device=dev).expert_groups
              for rows in (8, 16, 96, 128, 512, 768, 769, 1024, 2048)]
    assert groups == [False, True, True, True, True, True, False, False, False]
    assert tail.expert_groups and not big.expert_groups

