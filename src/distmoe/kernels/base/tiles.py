"""``@triton.jit`` helpers used by several kernel families, and their host references.

* :func:`tile_expert`: the expert of a padded row tile; :func:`tile_activation_rows` /
  :func:`tile_live_rows`: its activation rows.
* :func:`swizzle_tile`: the group-M tile swizzle; :func:`fused_tile`: the fused W13 + W2
  schedule (:func:`fused_schedule_ref` on the host).
* :func:`column_halves`: the two column halves of a tile (SwiGLU's ``g`` and ``u``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_expert(
    padded_offsets_ptr, row_start, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr
):
    """Local expert owning the row tile that starts at ``row_start``.

    Counts the segment ends ``padded_offsets[1:]`` at or below ``row_start`` (empty experts
    included), clamped to the last expert (callers only ask for live tiles).
    ``EXPERTS_POW2`` is ``next_power_of_2(NUM_EXPERTS)``.
    """
    idx = tl.arange(0, EXPERTS_POW2)
    ends = tl.load(padded_offsets_ptr + 1 + idx, mask=idx < NUM_EXPERTS, other=2147483647)
    expert = tl.sum((ends <= row_start).to(tl.int32), axis=0)
    return tl.minimum(expert, NUM_EXPERTS - 1)


@triton.jit
def swizzle_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Group-M order: ``GROUP_M`` consecutive row tiles sweep the columns together, so
    programs running at the same time share weight tiles (and row tiles) in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def fused_tile(t, num_pid_m, N13: tl.constexpr, N2: tl.constexpr, GROUP_M: tl.constexpr,
               LAG: tl.constexpr):
    """Position ``t`` of a fused W13 + W2 schedule (:mod:`distmoe.kernels.mega.gluon`):
    ``(is_w2, index)``, the index in that GEMM's own group-M stream (:func:`swizzle_tile`
    with ``N13`` or ``N2`` column tiles; ``num_pid_m`` row blocks in both).

    The schedule runs in periods of ``GROUP_M`` row blocks: period ``p`` holds W13's group
    ``p``, then W2's group ``p - LAG`` (``L = min(LAG, groups)``, ``LAG >= 1``), so a W2
    tile comes at least ``L`` W13 groups after the W13 tiles of its rows. Only the last
    group of each GEMM may be short. :func:`fused_schedule_ref` is the reference."""
    S13 = GROUP_M * N13
    S2 = GROUP_M * N2
    n13 = num_pid_m * N13
    ng = (num_pid_m + GROUP_M - 1) // GROUP_M
    lag = tl.minimum(ng, LAG)
    period = S13 + S2
    # every W13 group first, then every W2 group (lag reaches the group count)
    all_first_w2 = t >= n13
    all_first_idx = tl.where(all_first_w2, t - n13, t)
    # the first lag W13 groups (full), the periods lag .. ng - 2 (full), then the last
    # W13 group (maybe short) and the W2 groups left (the last one maybe short)
    head = lag * S13
    u = tl.maximum(t - head, 0)
    regular = (ng - 1 - lag) * period
    p_rel = u // period
    r = u % period
    reg_w2 = r >= S13
    reg_idx = tl.where(reg_w2, p_rel * S2 + r - S13, (p_rel + lag) * S13 + r)
    t2 = u - regular
    last13 = n13 - (ng - 1) * S13
    tail_w2 = t2 >= last13
    tail_idx = tl.where(tail_w2, (ng - 1 - lag) * S2 + t2 - last13, (ng - 1) * S13 + t2)
    in_head = t < head
    in_reg = u < regular
    lagged_w2 = tl.where(in_head, False, tl.where(in_reg, reg_w2, tail_w2))
    lagged_idx = tl.where(in_head, t, tl.where(in_reg, reg_idx, tail_idx))
    short = lag >= ng
    return (tl.where(short, all_first_w2, lagged_w2),
            tl.where(short, all_first_idx, lagged_idx))


def fused_schedule_ref(num_pid_m: int, n13: int, n2: int, group_m: int,
                       lag: int) -> list[tuple[bool, int]]:
    """The positions of :func:`fused_tile`, built period by period: ``(is_w2, index)``."""
    groups = -(-num_pid_m // group_m)
    lag = min(lag, groups)
    size = [min(group_m, num_pid_m - g * group_m) for g in range(groups)]
    first = [g * group_m for g in range(groups)]
    out: list[tuple[bool, int]] = []
    for p in range(groups + lag):
        if p < groups:
            out += [(False, first[p] * n13 + i) for i in range(size[p] * n13)]
        q = p - lag
        if 0 <= q < groups:
            out += [(True, first[q] * n2 + i) for i in range(size[q] * n2)]
    return out


@triton.jit
def tile_activation_rows(padded_offsets_ptr, row_offsets_ptr, expert, row_start):
    """Activation rows of the row tile at padded row ``row_start`` of ``expert``.

    Returns ``(act_start, num_live)``: the tile's padded row ``row_start + i`` maps to
    activation row ``act_start + i`` (int64) and is live iff ``i < num_live`` (``num_live``
    int32, <= 0 for a tile of padding rows only, may exceed ``BLOCK_M``).
    """
    seg_start = tl.load(padded_offsets_ptr + expert)
    act_begin = tl.load(row_offsets_ptr + expert)
    act_end = tl.load(row_offsets_ptr + expert + 1)
    local = row_start - seg_start
    act_start = act_begin.to(tl.int64) + local
    num_live = act_end - act_begin - local
    return act_start, num_live


@triton.jit
def tile_row_addresses(table_ptr, padded_offsets_ptr, row_offsets_ptr,
                       NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    """This program's row tile (grid axis 0: ``BLOCK_M`` padded rows, inside one expert's
    segment) in a table of one int64 address per padded row (gather or scatter pointers).

    Returns ``(act_start, num_live, idx, is_live, addresses)``: :func:`tile_activation_rows`'s
    pair, ``idx = arange(BLOCK_M)``, ``is_live = idx < num_live`` and the live rows' table
    entries (0 elsewhere: padding rows' entries are never read)."""
    row_start = tl.program_id(0) * BLOCK_M
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(padded_offsets_ptr, row_offsets_ptr, expert,
                                               row_start)
    idx = tl.arange(0, BLOCK_M)
    is_live = idx < num_live
    addresses = tl.load(table_ptr + row_start + idx, mask=is_live, other=0)
    return act_start, num_live, idx, is_live, addresses


@triton.jit
def tile_live_rows(padded_offsets_ptr, row_offsets_ptr, expert, row_start):
    """:func:`tile_activation_rows` with an int32 ``act_start``: the backward kernels use it
    as a TMA row coordinate (int32) and in int32 row arithmetic."""
    act_start, num_live = tile_activation_rows(padded_offsets_ptr, row_offsets_ptr, expert,
                                               row_start)
    return act_start.to(tl.int32), num_live


@triton.jit
def column_halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``x[:, :COLS/2]`` and ``x[:, COLS/2:]`` of a ``[ROWS, COLS]`` tile."""
    return tl.split(tl.permute(tl.reshape(x, [ROWS, 2, COLS // 2]), (0, 2, 1)))
