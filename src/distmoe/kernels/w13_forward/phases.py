"""A two-launch W13 schedule: row blocks of the rank's own tokens first, while peers' copy.

At EP > 1 with every peer token copied by the copy engines
(:func:`distmoe.plan.rules.pull_all`), a W13 in one launch waits for the whole copy before its
first tile, and part of the copy stays exposed after the routing tables. Yet each local
expert's rows are in source-rank order, so the rows of the rank's own tokens are contiguous
within every expert, and whole 128-row blocks of them read nothing that is being copied.
This module orders the W13's row blocks so that the first launch computes only such blocks
and the second, after the copy is joined, all the others:

    peer[b]   = 1 if a row of padded block b names a pulled (peer) token, else 0
                (written by :func:`~distmoe.kernels.movement.pull_tokens.pull_tokens` with
                ``block_flags``, where it rewrites the table anyway)
    n_b       = padded_offsets[E] / BLOCK_M           blocks of this call
    own(b)    = peer[b] == 0 and b < n_b
    paired(b) = own(b) and a neighbour block of the same expert is own too
    single(b) = own(b) and not paired(b)
    n_pair    = min(first, #paired);  n_single = min(first - n_pair, #single)
    moved(b)  = the first n_pair paired blocks and the first n_single single ones
    c(b)      = #{moved(b') : b' < b}                 (exclusive prefix)
    n1        = n_pair + n_single
    order[c(b)]          = b   for moved b            (positions 0 .. n1 - 1)
    order[n1 + b - c(b)] = b   for the others         (positions n1 .. n_b - 1)
    positions = [0, n1, n1, n_b]

Paired blocks go first because a tile streams its expert's weight tiles: a first launch of
single blocks, each from another expert, reads a whole expert's weights per block and is
bound by memory (evidence: docs/performance.md).

``order`` is a permutation of the call's blocks that keeps natural order within each phase
(group-M order and its L2 reuse of weight tiles stay), and
:func:`~distmoe.kernels.w13_forward.triton.gather_w13_swiglu` with ``order`` and
``positions[0:2]``, then ``positions[2:4]``, computes every tile exactly once. The tile
results do not depend on the order, so the output is bit-identical to one launch.

``first`` is a host number of blocks: whole waves of the persistent W13 for part of the
copy's time (:func:`phase_waves`, :func:`first_blocks`). Where fewer own blocks exist, the
first launch simply has fewer tiles. One program: the experts' first blocks into a scratch
array, then two passes over chunks of ``CHUNK`` blocks (counts, then positions); grids from
static bounds, no host synchronisation, capturable in a CUDA graph. The layer uses this
where :func:`distmoe.plan.rules.w13_phases` says so.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_tensor
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context

_CHUNK = 1024


@triton.jit
def _tiers(peer_ptr, starts_ptr, b, n_b):
    """``(paired, single)`` int32 flags of blocks ``b`` (module docstring)."""
    live = b < n_b
    own = live & (tl.load(peer_ptr + b, mask=live, other=1) == 0)
    has_prev = live & (b >= 1)
    prev = has_prev & (tl.load(peer_ptr + b - 1, mask=has_prev, other=1) == 0) & (
        tl.load(starts_ptr + b, mask=live, other=1) == 0)
    has_next = b + 1 < n_b
    nxt = has_next & (tl.load(peer_ptr + b + 1, mask=has_next, other=1) == 0) & (
        tl.load(starts_ptr + b + 1, mask=has_next, other=1) == 0)
    paired = own & (prev | nxt)
    return paired.to(tl.int32), (own & ~paired).to(tl.int32)


@triton.jit
def _phase_order_kernel(peer_ptr, starts_ptr, padded_offsets_ptr, order_ptr, positions_ptr,
                        first, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    n_b = tl.load(padded_offsets_ptr + NUM_EXPERTS) // BLOCK_M
    # starts[b] = 1 where block b is an expert's first (scratch, n_b + 1 entries)
    b0 = 0
    while b0 <= n_b:  # (while: Triton 3.6's interpreter cannot range over a loaded value)
        b = b0 + tl.arange(0, CHUNK)
        tl.store(starts_ptr + b, tl.zeros([CHUNK], tl.int8), mask=b <= n_b)
        b0 += CHUNK
    tl.debug_barrier()
    e = tl.arange(0, EXPERTS_POW2)
    inner = (e >= 1) & (e < NUM_EXPERTS)
    first_block = tl.load(padded_offsets_ptr + e, mask=inner, other=0) // BLOCK_M
    tl.store(starts_ptr + first_block, tl.full([EXPERTS_POW2], 1, tl.int8), mask=inner)
    tl.debug_barrier()
    # pass 1: how many blocks of each tier
    pairs = 0
    singles = 0
    b0 = 0
    while b0 < n_b:
        b = b0 + tl.arange(0, CHUNK)
        paired, single = _tiers(peer_ptr, starts_ptr, b, n_b)
        pairs += tl.sum(paired, axis=0)
        singles += tl.sum(single, axis=0)
        b0 += CHUNK
    n_pair = tl.minimum(pairs, first)
    n_single = tl.minimum(singles, first - n_pair)
    n1 = n_pair + n_single
    # pass 2: each block's position
    c_pair = 0
    c_single = 0
    c_moved = 0
    b0 = 0
    while b0 < n_b:
        b = b0 + tl.arange(0, CHUNK)
        live = b < n_b
        paired, single = _tiers(peer_ptr, starts_ptr, b, n_b)
        rank_p = c_pair + tl.cumsum(paired, axis=0) - paired
        rank_s = c_single + tl.cumsum(single, axis=0) - single
        moved = (((paired != 0) & (rank_p < n_pair)) | ((single != 0) & (rank_s < n_single)))
        moved = moved.to(tl.int32)
        c = c_moved + tl.cumsum(moved, axis=0) - moved
        pos = tl.where(moved != 0, c, n1 + b - c)
        tl.store(order_ptr + pos, b, mask=live)
        c_pair += tl.sum(paired, axis=0)
        c_single += tl.sum(single, axis=0)
        c_moved += tl.sum(moved, axis=0)
        b0 += CHUNK
    tl.store(positions_ptr + 0, 0)
    tl.store(positions_ptr + 1, n1)
    tl.store(positions_ptr + 2, n1)
    tl.store(positions_ptr + 3, n_b)


def w13_phase_order(block_peer: torch.Tensor, padded_offsets: torch.Tensor,
                    order: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor, *,
                    first: int, block_m: int = 128) -> None:
    """Write ``order`` and ``positions`` (module docstring) on the device.

    Args:
        block_peer: int8 ``[NB_cap]``: nonzero where a padded block of ``block_m`` rows names a
            peer token (``NB_cap = R_cap / block_m``).
        padded_offsets: int32 ``[E_local + 1]`` (device) of the routing tables.
        order: int32 ``[NB_cap]`` (written: entries ``0 .. n_b - 1``).
        positions: int32 ``[4]`` (written): ``[0, n1, n1, n_b]``, the block positions of the
            first launch and of the second.
        starts: int8 ``[NB_cap + 1]`` scratch (overwritten): which blocks start an expert.
        first: at most this many own blocks go first (an int >= 0).
        block_m: rows per block (the W13's tile rows).
    """
    check_tensor("block_peer", block_peer, dtypes=(torch.int8,), ndim=1, shape_text="[NB_cap]")
    nb_cap = block_peer.shape[0]
    check_tensor("padded_offsets", padded_offsets, dtypes=(torch.int32,), ndim=1,
                 shape_text="[E_local + 1]")
    if padded_offsets.shape[0] < 2:
        raise ValueError(f"padded_offsets must be [E_local + 1] with E_local >= 1, got shape "
                         f"{list(padded_offsets.shape)}")
    check_tensor("order", order, dtypes=(torch.int32,), shape=[nb_cap], shape_text="[NB_cap]")
    check_tensor("positions", positions, dtypes=(torch.int32,), shape=[4],
                 shape_text="[lo1, hi1, lo2, hi2]")
    check_tensor("starts", starts, dtypes=(torch.int8,), shape=[nb_cap + 1],
                 shape_text="[NB_cap + 1] (scratch)")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"first ({first!r}) must be an int >= 0")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m ({block_m!r}) must be a positive int")
    for name, t in (("padded_offsets", padded_offsets), ("order", order),
                    ("positions", positions), ("starts", starts)):
        if t.device != block_peer.device:
            raise ValueError(f"{name} must be on {block_peer.device}, got {t.device}")
    experts = padded_offsets.shape[0] - 1
    with device_context(block_peer.device):
        _phase_order_kernel[(1,)](block_peer, starts, padded_offsets, order, positions, first,
                                  NUM_EXPERTS=experts, EXPERTS_POW2=next_power_of_2(experts),
                                  BLOCK_M=block_m, CHUNK=_CHUNK, num_warps=4)


def w13_phase_order_ref(block_peer: torch.Tensor, padded_offsets: torch.Tensor, *,
                        first: int, block_m: int = 128) -> tuple[list[int], list[int]]:
    """Plain-Python ``(order[:n_b], positions)`` of :func:`w13_phase_order` (synchronises)."""
    po = [int(v) for v in padded_offsets.tolist()]
    n_b = po[-1] // block_m
    peer = block_peer[:n_b].tolist()
    expert = [max(e for e in range(len(po) - 1) if po[e] <= b * block_m) for b in range(n_b)]
    own = [p == 0 for p in peer]
    paired = [own[b] and any(0 <= n < n_b and own[n] and expert[n] == expert[b]
                             for n in (b - 1, b + 1)) for b in range(n_b)]
    pairs = [b for b in range(n_b) if paired[b]]
    singles = [b for b in range(n_b) if own[b] and not paired[b]]
    n_pair = min(first, len(pairs))
    moved = set(pairs[:n_pair] + singles[:min(first - n_pair, len(singles))])
    first_launch = [b for b in range(n_b) if b in moved]
    rest = [b for b in range(n_b) if b not in moved]
    n1 = len(first_launch)
    return first_launch + rest, [0, n1, n1, n_b]


def phase_waves(*, copy_bytes: int, tile_flops: int, head_start_s: float = 30e-6,
                latency_s: float = 5e-6, link_bytes_per_s: float = 350e9,
                sm_flops_per_s: float = 5e12, share: float = 0.5) -> int:
    """Whole waves of the persistent W13 (one tile per program each) for the first launch:
    ``share`` of the copy's remaining time, in tile times, rounded up, at least one.

    The remaining time is the copy of ``copy_bytes`` plus ``latency_s`` (the copy engines'
    join) less ``head_start_s`` (the copy starts with the routing tables, before the W13); a
    tile takes ``tile_flops`` at ``sm_flops_per_s`` per SM. The defaults are rough Hopper
    rates of the copy and of a cooperative 128 x 128 tile, and ``share`` fits sustained load
    rather than a short burst: every tile of the first launch reads its expert's weights
    once more, and the overlap runs the copy, the link and the W13 at once under the power
    limit (evidence: docs/performance.md)."""
    copy_s = copy_bytes / link_bytes_per_s + latency_s - head_start_s
    return max(1, math.ceil(share * copy_s * sm_flops_per_s / tile_flops))


def first_blocks(*, waves: int, programs: int, num_pid_n: int) -> int:
    """Own blocks for the first launch: ``waves`` waves of ``programs`` tiles, ``num_pid_n``
    column tiles per block (rounded down, at least one block)."""
    for name, v in (("waves", waves), ("programs", programs), ("num_pid_n", num_pid_n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} ({v!r}) must be an int >= 1")
    return max(1, waves * programs // num_pid_n)


__all__ = ["first_blocks", "phase_waves", "w13_phase_order", "w13_phase_order_ref"]
