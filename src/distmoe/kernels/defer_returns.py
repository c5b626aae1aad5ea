"""Keep some route results with their expert: the W2 return table rewritten (inference, EP > 1).

At EP > 1 the W2 epilogue stores each row into its owner's combine buffer. Where W2's FLOPs
per row are few (small F), those peer stores, not the GEMM, set W2's time (docs/performance.md
runs 33-37: 214-222 us at T=4096, D=2048, F=768, E=128, K=8 against 159-166 for the same
GEMM with local stores), while during the owner's combine the link is idle. This module moves
a share of the bytes from the first phase to the second: every ``every``-th route slot of a
peer's tokens is stored locally, into this rank's *deferred region*, and the owner's combine
reads it from there across NVLink (:class:`distmoe.kernels.combine.DeferredReads`). The same
rows are summed in the same order, so y is the same, bit for bit.

Layout: a rank's region holds ``EP`` segments of ``segment = ceil(T_max * K / every)`` rows
(bf16, ``D`` columns); route slot ``s = t*K + k`` of owner ``o`` (``s % every == 0``) is row
``o * segment + s // every``. Segment ``rank`` of a rank's own region stays unused.

:func:`defer_returns` rewrites the W2 return table (``RoutingTables.scatter_ptrs``) in one
launch over its ``R_cap`` rows (a grid fixed by the configured bound): rows of a peer's route
at such a slot get their region address, the others keep theirs. No host synchronisation.

Ordering (the layer's): the region is written by this rank's W2, read by the owners' combines
after the end barrier, and written again only after the next call's publish barrier, which
every owner reaches after its combine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels._common import check_devices, check_tensor, device_context

_BLOCK = 1024


@triton.jit
def _defer_returns_kernel(scatter_ptr, route_ptr, out_ptr, num_rows, routes_per_rank, rank,
                          region_base, segment, row_bytes, EVERY: tl.constexpr,
                          BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < num_rows
    route = tl.load(route_ptr + rows, mask=in_range, other=-1)
    addr = tl.load(scatter_ptr + rows, mask=in_range, other=0)
    owner = route // routes_per_rank
    slot = route - owner * routes_per_rank
    keep = (route >= 0) & (owner != rank) & (slot % EVERY == 0)
    local = region_base + (owner * segment + slot // EVERY) * row_bytes
    tl.store(out_ptr + rows, tl.where(keep, local, addr), mask=in_range)


def region_rows(max_tokens: int, top_k: int, every: int, ep_size: int) -> tuple[int, int]:
    """``(segment, rows)`` of a rank's deferred region: ``segment = ceil(T_max*K / every)``
    rows per owner rank, ``rows = EP * segment``."""
    for name, value in (("max_tokens", max_tokens), ("top_k", top_k), ("every", every),
                        ("ep_size", ep_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    segment = -(-max_tokens * top_k // every)
    return segment, ep_size * segment


def defer_returns(scatter_ptrs: torch.Tensor, route_of_row: torch.Tensor, out: torch.Tensor, *,
                  rank: int, routes_per_rank: int, every: int, segment: int,
                  region_base: int, row_bytes: int) -> torch.Tensor:
    """``out[i]``: this rank's region address of row ``i``'s route where that route is a
    peer's at a slot divisible by ``every``, else ``scatter_ptrs[i]``.

    Args:
        scatter_ptrs: int64 ``[R]`` return addresses (0 = a null row).
        route_of_row: int64 ``[R]`` flat route index ``src * T*K + t*K + k`` (-1 = null).
        out: int64 ``[R]``, written (it may be ``scatter_ptrs`` itself).
        rank: this rank (``src == rank`` rows keep their address).
        routes_per_rank: ``T * K`` of the call.
        every: the period of deferred slots (>= 1).
        segment: rows per owner in the region (:func:`region_rows`), at least
            ``ceil(routes_per_rank / every)``.
        region_base: the region's byte address on this rank (16-byte aligned).
        row_bytes: ``D * 2``.

    Returns ``out``.
    """
    check_tensor("scatter_ptrs", scatter_ptrs, dtypes=(torch.int64,), ndim=1, shape_text="[R]")
    n = scatter_ptrs.shape[0]
    for name, t in (("route_of_row", route_of_row), ("out", out)):
        check_tensor(name, t, dtypes=(torch.int64,), shape=[n], shape_text="[R]")
    for name, value, low in (("rank", rank, 0), ("routes_per_rank", routes_per_rank, 1),
                             ("every", every, 1), ("segment", segment, 0),
                             ("region_base", region_base, 0), ("row_bytes", row_bytes, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if segment * every < routes_per_rank:
        raise ValueError(f"segment ({segment}) x every ({every}) must cover the "
                         f"routes_per_rank = {routes_per_rank} slots")
    if region_base % 16:
        raise ValueError(f"region_base must be 16-byte aligned, got {region_base:#x}")
    check_devices(dict(scatter_ptrs=scatter_ptrs, route_of_row=route_of_row, out=out),
                  for_kernel=True)
    if n == 0:
        return out
    with device_context(out.device):
        _defer_returns_kernel[(triton.cdiv(n, _BLOCK),)](
            scatter_ptrs, route_of_row, out, n, routes_per_rank, rank, region_base, segment,
            row_bytes, EVERY=every, BLOCK=_BLOCK)
    return out


def defer_returns_ref(scatter_ptrs, route_of_row, *, rank, routes_per_rank, every, segment,
                      region_base, row_bytes) -> torch.Tensor:
    """Plain-PyTorch :func:`defer_returns` (a new tensor)."""
    owner = torch.div(route_of_row, routes_per_rank, rounding_mode="floor")
    slot = route_of_row - owner * routes_per_rank
    keep = (route_of_row >= 0) & (owner != rank) & (slot % every == 0)
    local = region_base + (owner * segment + torch.div(slot, every, rounding_mode="floor")) \
        * row_bytes
    return torch.where(keep, local, scatter_ptrs)
