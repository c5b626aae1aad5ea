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

Shared by the backward kernel tests (``w2_dgrad/``, ``w13_dgrad/``, ``wgrad/``, ``movement/test_route_grad.py``, ``test_backward_chain.py``, ``test_backward_configs.py``): the layouts, problems and checks above. (The suite-wide seed fixture of tests/conftest.py seeds each test from its node id, as this module's own fixture did.)
"""

import math
from dataclasses import dataclass

import torch

from distmoe.kernels.base.device import gemm_grid
from distmoe.kernels.base.interpreter import use_interpreter_if_no_gpu
from distmoe.kernels.base.rows import compact_segments

INTERPRETED = use_interpreter_if_no_gpu()


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# One fp32 -> bf16 rounding (to nearest even, on the GPU and, through the correction in
# distmoe.kernels.base.interpreter, in the interpreter) is off by at most half a bf16 spacing:
# 2^-8 relative at most.
ROUNDING_REL = 2.0**-8


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


def assert_walks_several_tiles(config, num_tiles_cap, live_tiles):
    """Under the interpreter a persistent grid has fewer programs than live tiles, so programs
    walk several tiles (on a GPU the grid is one program per SM)."""
    programs = gemm_grid(config, num_tiles_cap, DEVICE)
    if INTERPRETED:
        assert programs < live_tiles, (programs, live_tiles)
