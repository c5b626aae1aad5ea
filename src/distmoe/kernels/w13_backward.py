"""W13 backward: DGRAD with a scatter epilogue that returns route input gradients, and WGRAD.

Row layout: the padded tile schedule and compact activation rows of
:mod:`distmoe.kernels.w2_backward` (``padded_offsets`` schedules the tiles and indexes
``scatter_ptrs``; ``row_offsets`` maps live padded row ``padded_offsets[e] + j``, ``j < n_e``,
to activation row ``row_offsets[e] + j``; padding rows have no activation row; ``grad_h1`` and
``x_gathered`` are in activation rows, ``[R_act, width]`` with ``R_act >= row_offsets[E_local]``).
Per live row, with ``grad_h1 = [grad_g | grad_u]`` from
:func:`distmoe.kernels.w2_backward.w2_dgrad_swiglu_bwd` and ``W13 = w13[e]`` viewed ``[2F, D]``::

    grad_x_route = grad_h1 @ W13              [R, 2F] @ [2F, D], fp32 accumulation -> bf16
    grad_W13[e] += grad_h1_e^T @ x_e          fp32 [2F, D] (= [2, F, D])

:func:`w13_dgrad_scatter`
    One program per (padded row tile, ``block_n`` columns of D) of the ``R_cap`` bound; idle
    tiles and tiles of padding rows only exit at once. With ``persistent``: one program per SM
    (at most one per tile of the bound), each walking the live tiles (their count read on the
    device from ``padded_offsets[E]``) with a stride of the grid, or (``dynamic``) taking
    each next tile from a device counter, its descriptors built once; every tile is computed
    the same way on both grids. ``pair_tails``: an expert's short last tile is computed with
    the tile before it, the weight tiles loaded once for both (:class:`W13DgradConfig`).
    ``grad_h1`` (local, contiguous) and the weights come through TMA descriptors
    (``[R_act, 2F]`` and ``[E, 2F, D]``; encoded on the host at launch by default, or built
    in every program). A tile reads the ``block_m`` activation rows that follow its first
    row's; its padding rows thereby read the next expert's rows, rows past the live end or
    TMA zeros, and their results are discarded. The epilogue stores each live bf16 row with
    a plain ``tl.store`` to ``scatter_ptrs[row]`` (indexed by padded row), an absolute
    address (usually route slot ``t*K + k`` of the token owner's dispatch buffer, possibly
    in a peer's memory); 0 = skip. Entries of padding and idle rows are never read (masked
    loads). Never a TMA store: the owner reads these rows after a release/acquire signal,
    and in triton 3.6 a later release does not order a TMA store. Every destination row is
    written by exactly one program per column tile, so no atomics. With
    ``W13DgradConfig.gluon`` (the heuristic's pick on Hopper from 128 rows per expert where
    the rank's W13 weights total under 2 GiB), the warp-specialised Gluon kernel of the W2
    forward runs it instead (:func:`~distmoe.kernels.w2_gluon.\
launch_gluon_w13_dgrad`: same tiles read, same stores, one program per SM).

:func:`w13_wgrad`
    The grouped WGRAD kernel of :mod:`distmoe.kernels.w2_backward` with ``A = grad_h1``
    (P = 2F) and ``B = x_gathered`` (Q = D), walking each expert's activation rows (the last,
    partial row step masked), accumulated in place into fp32 ``grad_w13 [E, 2, F, D]`` viewed
    ``[E, 2F, D]``. ``x_gathered`` is a 2-D tensor or, with ``x_offset`` (int64 ``[1]`` on the
    device, a bf16 element offset such as a slot cursor), a 1-D base with activation row ``a``
    at ``x_gathered + x_offset[0] + a*D``. A host-encoded TMA descriptor cannot see that
    offset, so on that path this operand's descriptor is built in every program
    (``tl.make_tensor_descriptor`` over ``row_offsets[E_local]`` rows from the offset base),
    while ``grad_h1`` keeps its host descriptor unless ``host_descriptors`` is False.

Requirements (device-side, not checked): the layout rules; non-null scatter addresses 16-byte
aligned; ``x_offset[0]`` a multiple of 8 elements (16-byte aligned TMA base) and the base
holding ``x_offset[0] + row_offsets[E_local]*D`` elements.

Sync points: none inside. The caller signals the owners after ``w13_dgrad_scatter``
(barrier) before they run ``reduce_routes``. Grids come from ``R_cap``, ``E_local``, the
weight shapes and (persistent DGRAD) the SM count (no host synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels._common import (
    GemmConfig,
    check_devices,
    check_offsets,
    check_tensor,
    check_tma_aligned,
    check_width,
    config_gluon_reason,
    device_context,
    ensure_tma_allocator,
    gemm_grid,
    gluon_device,
    next_power_of_2,
    swizzle_tile,
    tile_expert,
    warn_gluon_fallback,
)
from distmoe.kernels.w2_backward import (
    WgradConfig,
    check_activation_rows,
    check_backward_gemm_config,
    check_base_tensor,
    check_device_scalar,
    check_disjoint,
    check_row_table,
    check_rows_cap,
    check_wgrad_config,
    compact_segments,
    launch_grouped_wgrad,
    tile_live_rows,
)


def _pow2_clamped(n: int, low: int, high: int) -> int:
    return min(high, max(low, next_power_of_2(n)))


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _w13_dgrad_descs(
    grad_h1,
    w13,
    num_act_rows,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """TMA descriptors built on the device (128 bytes of scratch and a tensormap fence each)
    over grad_h1 ``[R_act, 2F]`` and w13 ``[E, 2F, D]``."""
    a_desc = tl.make_tensor_descriptor(
        grad_h1,
        shape=[num_act_rows, 2 * FFN],
        strides=[2 * FFN, 1],
        block_shape=[BLOCK_M, BLOCK_K],
    )
    w_desc = tl.make_tensor_descriptor(
        w13,
        shape=[NUM_EXPERTS, 2 * FFN, HIDDEN],
        strides=[2 * FFN * HIDDEN, HIDDEN, 1],
        block_shape=[1, BLOCK_K, BLOCK_N],
    )
    return a_desc, w_desc


@triton.jit
def _w13_dgrad_all_descs(grad_h1, grad_h1_half, w13, w13_half, num_act_rows,
                         HIDDEN: tl.constexpr, FFN: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         READY: tl.constexpr, PAIR_TAILS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(a, w, a_half, w_half)``: the descriptors as passed (``READY``), else built here (the
    half ones, ``BLOCK_M / 2`` rows and ``BLOCK_N / 2`` columns, only with ``PAIR_TAILS``;
    without it they are the whole ones, unused)."""
    if READY:
        a_desc = grad_h1
        w_desc = w13
        ah_desc = grad_h1_half
        wh_desc = w13_half
    else:
        a_desc, w_desc = _w13_dgrad_descs(grad_h1, w13, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
                                          BLOCK_M, BLOCK_N, BLOCK_K)
        ah_desc = a_desc
        wh_desc = w_desc
        if PAIR_TAILS:
            ah_desc, wh_desc = _w13_dgrad_descs(grad_h1, w13, num_act_rows, HIDDEN, FFN,
                                                NUM_EXPERTS, BLOCK_M // 2, BLOCK_N // 2,
                                                BLOCK_K)
    return a_desc, w_desc, ah_desc, wh_desc


@triton.jit
def _w13_dgrad_store(scatter_ptrs_ptr, row0, num_live, acc, n0, HIDDEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scatter the bf16 rows of ``acc`` (``[BLOCK_M, BLOCK_N]``, columns from ``n0``) of the
    tile at padded row ``row0``, its first ``num_live`` rows live."""
    idx = tl.arange(0, BLOCK_M)
    is_live = idx < num_live
    # Entries of padding rows are not read (the routing layer writes 0 there anyway).
    addr = tl.load(scatter_ptrs_ptr + row0 + idx, mask=is_live, other=0)
    is_row = addr != 0
    # Destination rows are 16-byte aligned (contract): 16-byte vector stores. The hint goes
    # on the pointer (divisibility in bytes); on the int64 before the cast it would be lost.
    dst = tl.multiple_of(addr.to(tl.pointer_type(tl.bfloat16)), 16)
    col = n0 + tl.arange(0, BLOCK_N)
    tl.store(
        dst[:, None] + col[None, :],
        acc.to(tl.bfloat16),
        mask=is_row[:, None] & (col < HIDDEN)[None, :],
    )


@triton.jit
def _w13_dgrad_tile(
    grad_h1,
    grad_h1_half,
    w13_half,
    padded_offsets_ptr,
    row_offsets_ptr,
    w13,
    scatter_ptrs_ptr,
    num_act_rows,
    pid_m,
    pid_n,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    DESC_READY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAIR_TAILS: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of grad_x_route, scattered, for a row tile below
    ``padded_offsets[E]``. A tile of padding rows only loads and stores nothing.

    ``PAIR_TAILS``: an expert's last row tile with at most ``BLOCK_M / 2`` live rows (a
    tail; not the expert's only tile) is computed with the tile before it, which then runs
    as two ``(BLOCK_M + BLOCK_M / 2) x BLOCK_N / 2`` halves, each K step's weight tile
    feeding a ``BLOCK_M``-row MMA for the tile and a ``BLOCK_M / 2``-row one for the tail:
    the weights are read once for both, and the tail's dead half takes no MMA (its own
    tile exits).

    ``grad_h1`` / ``grad_h1_half`` / ``w13`` / ``w13_half``: TMA descriptors (``DESC_READY``:
    host-encoded, or built once per persistent program; the ``_half`` ones with ``BLOCK_M /
    2`` rows and ``BLOCK_N / 2`` columns), else the tensors, whose descriptors are built
    here once the tile is known to hold live rows.
    """
    HALF_M: tl.constexpr = BLOCK_M // 2
    HALF_N: tl.constexpr = BLOCK_N // 2
    row0 = pid_m * BLOCK_M
    expert = tile_expert(padded_offsets_ptr, row0, NUM_EXPERTS, EXPERTS_POW2)
    act0, num_live = tile_live_rows(padded_offsets_ptr, row_offsets_ptr, expert, row0)
    single = num_live > 0
    if PAIR_TAILS:
        # live rows count from row0 to the expert's end: (BLOCK_M, BLOCK_M + HALF_M] makes
        # this tile and the expert's tail a pair; (0, HALF_M] past its first tile is that tail
        pair = (num_live > BLOCK_M) & (num_live <= BLOCK_M + HALF_M)
        tail = (num_live <= HALF_M) & (row0 > tl.load(padded_offsets_ptr + expert))
        single = single & (pair == 0) & (tail == 0)
    # Live rows come first in a segment: a tile starting at a padding row has none.
    if single:
        n0 = pid_n * BLOCK_N
        a_desc, w_desc, _ah, _wh = _w13_dgrad_all_descs(
            grad_h1, grad_h1_half, w13, w13_half, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
            DESC_READY, False, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # Activation rows [act0, act0 + BLOCK_M): the tile's padding rows read past its
        # expert's rows (TMA zero-fills rows past R_act); their results are discarded below.
        for k0 in range(0, 2 * FFN, BLOCK_K):
            a = a_desc.load([act0, k0])
            b = w_desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc)
        _w13_dgrad_store(scatter_ptrs_ptr, row0, num_live, acc, n0, HIDDEN, BLOCK_M, BLOCK_N)
    if PAIR_TAILS:
        if pair:
            a_desc, _w, ah_desc, wh_desc = _w13_dgrad_all_descs(
                grad_h1, grad_h1_half, w13, w13_half, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
                DESC_READY, True, BLOCK_M, BLOCK_N, BLOCK_K)
            for h in range(2):
                n0 = pid_n * BLOCK_N + h * HALF_N
                acc0 = tl.zeros([BLOCK_M, HALF_N], dtype=tl.float32)
                acc1 = tl.zeros([HALF_M, HALF_N], dtype=tl.float32)
                for k0 in range(0, 2 * FFN, BLOCK_K):
                    a0 = a_desc.load([act0, k0])
                    a1 = ah_desc.load([act0 + BLOCK_M, k0])
                    b = wh_desc.load([expert, k0, n0]).reshape(BLOCK_K, HALF_N)
                    acc0 = tl.dot(a0, b, acc0)
                    acc1 = tl.dot(a1, b, acc1)
                _w13_dgrad_store(scatter_ptrs_ptr, row0, BLOCK_M, acc0, n0, HIDDEN, BLOCK_M,
                                 HALF_N)
                _w13_dgrad_store(scatter_ptrs_ptr, row0 + BLOCK_M, num_live - BLOCK_M, acc1,
                                 n0, HIDDEN, HALF_M, HALF_N)


@triton.jit
def _w13_dgrad_scatter_kernel(
    grad_h1,  # bf16 [R_act, 2F], or its TMA descriptor (HOST_DESC)
    grad_h1_half,  # PAIR_TAILS and HOST_DESC: its descriptor of BLOCK_M / 2 rows, else unused
    w13_half,  # PAIR_TAILS and HOST_DESC: w13's descriptor of BLOCK_N / 2 columns, else unused
    padded_offsets_ptr,  # int32 [E + 1]
    row_offsets_ptr,  # int32 [E + 1]
    w13,  # bf16 [E, 2F, D], or its TMA descriptor (HOST_DESC)
    scatter_ptrs_ptr,  # int64 [R_cap]: destination addresses of bf16 [D] rows (0 = skip)
    next_ptr,  # DYNAMIC: int32 [1], zero: the next tile to hand out; else unused
    num_rows,  # R_cap
    num_act_rows,  # R_act
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HOST_DESC: tl.constexpr,
    PERSISTENT: tl.constexpr,
    DYNAMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PAIR_TAILS: tl.constexpr,
):
    NUM_PID_N: tl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    if PERSISTENT:
        # Each program walks the live tiles (count read on the device) with a stride of the
        # grid; a while loop (not range) keeps the interpreter working too. Descriptors are
        # built once per program, and only by a program that has a tile: the others (fewer
        # live tiles than programs) exit at once.
        num_live_m = total_rows // BLOCK_M
        num_tiles = num_live_m * NUM_PID_N
        # DYNAMIC: each program takes its next tile from a counter when it is done with one,
        # so the tiles running at once stay neighbours in the group-M order (L2 reuse)
        # however long each tile takes; else a fixed stride of the grid
        tile_id = tl.program_id(0)
        if DYNAMIC:
            tile_id = tl.atomic_add(next_ptr, 1, sem="relaxed")
        if tile_id < num_tiles:
            a_desc, w_desc, ah_desc, wh_desc = _w13_dgrad_all_descs(
                grad_h1, grad_h1_half, w13, w13_half, num_act_rows, HIDDEN, FFN, NUM_EXPERTS,
                HOST_DESC, PAIR_TAILS, BLOCK_M, BLOCK_N, BLOCK_K)
            while tile_id < num_tiles:
                pid_m, pid_n = swizzle_tile(tile_id, num_live_m, NUM_PID_N, GROUP_M)
                _w13_dgrad_tile(
                    a_desc, ah_desc, wh_desc, padded_offsets_ptr, row_offsets_ptr, w_desc,
                    scatter_ptrs_ptr, num_act_rows, pid_m, pid_n, HIDDEN, FFN, NUM_EXPERTS,
                    EXPERTS_POW2, True, BLOCK_M, BLOCK_N, BLOCK_K, PAIR_TAILS,
                )  # fmt: skip
                if DYNAMIC:
                    tile_id = tl.atomic_add(next_ptr, 1, sem="relaxed")
                else:
                    tile_id += tl.num_programs(0)
    else:
        pid_m, pid_n = swizzle_tile(tl.program_id(0), num_rows // BLOCK_M, NUM_PID_N, GROUP_M)
        # Idle tiles (rows at/after padded_offsets[E]): no loads, no stores.
        if pid_m * BLOCK_M < total_rows:
            _w13_dgrad_tile(
                grad_h1, grad_h1_half, w13_half, padded_offsets_ptr, row_offsets_ptr, w13,
                scatter_ptrs_ptr,
                num_act_rows, pid_m, pid_n, HIDDEN, FFN, NUM_EXPERTS, EXPERTS_POW2, HOST_DESC,
                BLOCK_M, BLOCK_N, BLOCK_K, PAIR_TAILS,
            )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launch configuration and launchers
# --------------------------------------------------------------------------------------------


#: the largest W13 weights of one expert (2F x D bf16) for which the heuristic picks the Gluon
#: W13 DGRAD (:meth:`W13DgradConfig.hopper_gluon`): 32 MiB, T=8192 D=4096 F=2048's, where it
#: gained; DeepSeek-V3's 56 MiB lost (docs/performance.md run 44)
GLUON_W13_DGRAD_EXPERT_BYTES = 32 * 1024**2


@dataclass(frozen=True, kw_only=True)
class W13DgradConfig(GemmConfig):
    """Launch configuration of :func:`w13_dgrad_scatter` (see :class:`GemmConfig`).

    ``block_m`` rows (the padding multiple), ``block_n`` columns of D per tile, ``block_k``
    step over 2F. ``persistent``: one program per SM walking the live tiles (else one program
    per tile of the ``R_cap`` bound; the default until measured on an H200).
    ``host_descriptors`` covers the grad_h1 and w13 TMA descriptors.
    """

    #: An expert's last row tile with at most ``block_m / 2`` live rows (a tail) is computed
    #: with the tile before it: that tile runs as two halves of ``block_n / 2`` columns over
    #: both row tiles, each weight tile loaded once for the two. Under a routed histogram
    #: about half of the experts end in such a tail; where the kernel streams its weights
    #: (few rows per expert, wide experts) a tail otherwise costs a second read of them.
    #: Needs ``block_n >= 32``.
    pair_tails: bool = False
    #: Persistent programs take their tiles from a device counter (zeroed by the launcher
    #: each call) instead of a fixed stride, so that tiles of different lengths do not spread
    #: the running tiles apart in the group-M order. Needs ``persistent``.
    dynamic: bool = False
    #: Run the warp-specialised Gluon kernel of the W2 forward
    #: (:func:`~distmoe.kernels.w2_gluon.launch_gluon_w13_dgrad`: a TMA producer warp, two
    #: consumer warpgroups, the same row-scatter epilogue; the weight tiles read N-major as
    #: stored) where it can run: Hopper, not the interpreter, ``block_m`` 128, ``block_k``
    #: 64, D a multiple of ``block_n``, 2F of 64, a ring that fits
    #: (:func:`~distmoe.kernels.w2_gluon.gluon_w13_dgrad_reason`). ``num_warps`` counts the
    #: MMA warps of one tile: 4 (ping-pong 128 x 128 tiles) or 8 (cooperative 128 x 256).
    #: Elsewhere the Triton kernel runs this config (with a ``RuntimeWarning`` that says
    #: why). Uses ``num_stages`` and ``group_m``; ``persistent``, ``host_descriptors``,
    #: ``dynamic`` and ``pair_tails`` are the Triton kernel's (the Gluon programs, one per
    #: SM, walk their tiles with a fixed stride and pair no tails).
    gluon: bool = False
    #: The Gluon kernel's producers start each wave of tiles together (as
    #: :attr:`~distmoe.kernels.w2_scatter.W2Config.lockstep`, on the same kernel): each
    #: waits, a bounded spin on a device counter, until every program has issued the loads
    #: of its previous tile, so that the weight tiles an expert's row blocks share are read
    #: from L2 rather than DRAM again. Same bits; the Triton kernel ignores it.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w2_scatter.W2Config.expert_groups`, on the same
    #: kernel). Same bits; the Triton kernel ignores it. :meth:`hopper_gluon` sets it at 128
    #: to 512 rows per expert.
    expert_groups: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_backward_gemm_config(self)
        if self.dynamic and not self.persistent:
            raise ValueError("dynamic=True needs persistent=True (a counter hands out the "
                             "tiles of a persistent grid)")
        if self.pair_tails and self.block_n < 32:
            raise ValueError(f"pair_tails=True needs block_n >= 32, got block_n={self.block_n}")

    def with_grid(self, persistent: bool) -> W13DgradConfig:
        """:meth:`GemmConfig.with_grid`; the tile grid drops the ``dynamic`` hand-out."""
        return replace(self, persistent=persistent, dynamic=self.dynamic and persistent)

    @classmethod
    def from_heuristic(cls, *, hidden: int, ffn: int, block_m: int = 128,
                       rows_per_expert: int | None = None,
                       device: torch.device | None = None,
                       num_experts: int | None = None) -> W13DgradConfig:
        """128 x 128 x 64 tiles, 8 warps, 3 stages (96 KiB of SMEM); narrower tiles for
        narrow D/F. The plain scatter epilogue needs about 90 registers per thread (sm_90
        build), so two CTAs fit on an SM (registers and 2 x 96 KiB of SMEM): one CTA's
        epilogue and scatter stores overlap the other's main loop.

        With a ``rows_per_expert`` hint (balanced rows per local expert ``T*K*EP/E``, a shape
        key, never a routed count), ``block_m`` 128 and D >= 256: 128 x 256 tiles, 4 stages,
        persistent grid. Measured on one H200 (2026-11-29, ``tools/tune_gemm.py
        --backward``): at T=8192 D=4096 F=2048 E=32 K=8 3.00 ms against 3.64 for the default
        above (1.10x ``torch._grouped_mm`` on pre-gathered rows); at T=4096 D=2048 F=768 E=128
        K=8 0.410 against 0.446 ms. The tiles are handed out by a counter (``dynamic``) and
        an expert's short last tile is paired with the one before it (``pair_tails``):
        DeepSeek-V3's layer fwd+bwd 3.0% faster under sampled routing and 1.5% under the
        bench's exact one, T=4096 D=2048 F=768 E=128 even (one H200, 2026-11-30, run 40).

        With the hint, a ``device`` where the Gluon kernels run (Hopper, not the interpreter)
        and the local expert count ``num_experts``: the Gluon kernel where
        :meth:`hopper_gluon` picks it.
        """
        if rows_per_expert is not None and block_m == 128 and gluon_device(device):
            gluon = cls.hopper_gluon(hidden=hidden, ffn=ffn, rows_per_expert=rows_per_expert,
                                     num_experts=num_experts)
            if gluon is not None:
                return gluon
        if rows_per_expert is not None and block_m == 128 and hidden >= 256 and ffn >= 32:
            return cls(block_m=block_m, block_n=256, block_k=64, num_warps=8, num_stages=4,
                       persistent=True, dynamic=True, pair_tails=True)
        block_n = _pow2_clamped(hidden, 16, 128)
        block_k = _pow2_clamped(2 * ffn, 16, 64)
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        return cls(
            block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=3
        )

    @classmethod
    def hopper_gluon(cls, *, hidden: int, ffn: int, rows_per_expert: int,
                     num_experts: int | None) -> W13DgradConfig | None:
        """The Gluon config :meth:`from_heuristic` picks on a Hopper device (padding multiple
        128), or ``None`` where it keeps the Triton kernel: the Gluon W2 forward's kernel with
        ping-pong 128 x 128 tiles (``gluon``, ``num_warps`` 4), a ring of 6 stages from 256
        rows per expert and 5 below, from 128 rows per expert where the rank's W13 weights
        (``num_experts * 2F * D`` bf16) total under
        :data:`~distmoe.kernels._common.GLUON_MID_ROWS_WEIGHT_BYTES` (2 GiB), an expert's
        are at most :data:`GLUON_W13_DGRAD_EXPERT_BYTES` (32 MiB) and the kernel tiles the
        shape (D and 2F multiples of 64). The per-expert bound keeps DeepSeek-V3's
        experts (56 MiB each) on the Triton kernel at every EP size: at 8 ranks their total
        falls under 2 GiB, but nothing else about a tile changes, and at one rank the Gluon
        kernel lost there (why was not measured).

        Measured on one H200 (2026-12-01, docs/performance.md run 44), against the Triton
        pick (128 x 256 tiles, counter hand-out, paired tails); same bits:

        * the kernel alone (``perf/2026-12-01-h200-run44/w13d_micro.py``, 15 interleaved
          rounds): 1.24x at T=4096 D=2048 F=768 E=128 K=8 (exact and sampled routing),
          1.17x at OLMoE, 1.08x at T=8192 D=4096 F=2048 E=32 K=8 (5 stages), 1.11x at
          T=2048 D=2048 F=768 E=128 (5 stages; 6: 1.03x); 0.82-0.86x at DeepSeek-V3
          (E=256, D=7168: 15 GB of weights, sampled routing);
        * the layer's fwd+bwd (``tools/ab_interleaved.py``, 5-11 rounds): 3.5-4.6% faster
          at the second shape, 2.9% at OLMoE, 2.4-3.0% at the fourth, 1.2-2.7% at the
          third, 1.9% / 4.0% there with 1024 / 2048 tokens (256 / 512 rows per expert);
          slower where the weights total 8-15 GB: DeepSeek-V3 2.4-5.5%, DeepSeek-V4-Flash
          with 8192 tokens (E=256, D=4096, 192 rows per expert) 1%.

        With ``expert_groups`` at 128 to 512 rows per expert
        (:data:`~distmoe.kernels._common.EXPERT_GROUPS_W13_DGRAD_ROWS`): one H100,
        2026-12-06, run 59, the layer's fwd+bwd interleaved, 1.043x twice at the second shape
        under sampled routing (1.006x exact), 1.009x at OLMoE (T=4096 D=2048 F=1024 E=64
        K=8, 512 rows per expert); 0.951x at the first shape (2048 rows per expert, exact
        routing, 5 rounds). Run 60 (one H100, 2026-12-06, Nsight Compute on the kernel in
        the fwd+bwd step, sampled routing): 340 -> 324 us at the third shape, 233 -> 215 us
        at OLMoE with 1024 tokens (both 128 rows per expert), 478 -> 382 us at the second,
        505 -> 429 us at OLMoE; 942 -> 956 us there with 8192 tokens (1024 rows per
        expert).
        """
        from ._common import EXPERT_GROUPS_W13_DGRAD_ROWS, GLUON_MID_ROWS_WEIGHT_BYTES
        from .w2_gluon import shape_reason

        if rows_per_expert < 128 or num_experts is None:
            return None
        expert_bytes = 2 * ffn * hidden * 2
        if (num_experts * expert_bytes >= GLUON_MID_ROWS_WEIGHT_BYTES
                or expert_bytes > GLUON_W13_DGRAD_EXPERT_BYTES):
            return None
        stages = 6 if rows_per_expert >= 256 else 5
        if shape_reason(hidden=hidden, ffn=ffn, block_m=128, block_n=128, block_k=64,
                        stages=stages, warps=4, w13_dgrad=True) is not None:
            return None
        lo, hi = EXPERT_GROUPS_W13_DGRAD_ROWS
        return cls(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=stages,
                   group_m=8, persistent=True, gluon=True,
                   expert_groups=lo <= rows_per_expert <= hi)

    @classmethod
    def all_configs(cls, *, hidden: int, ffn: int, block_m: int = 128) -> list[W13DgradConfig]:
        """Tuning candidates that fit an SM90."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128, 256), block_ks=(32, 64, 128),
                         num_stages=(3, 4, 5), persistent=(False, True),
                         max_n=_pow2_clamped(hidden, 16, 256),
                         max_k=_pow2_clamped(2 * ffn, 16, 256))


def w13_dgrad_gluon_reason(config: W13DgradConfig, device: torch.device, hidden: int,
                           ffn: int) -> str | None:
    """``None`` when ``config`` runs the Gluon kernel on ``device`` at D = ``hidden``, F =
    ``ffn``, else why not (``config.gluon`` False included)."""
    from .w2_gluon import gluon_w13_dgrad_reason

    return config_gluon_reason(config, gluon_w13_dgrad_reason, device, hidden, ffn)


def w13_dgrad_scatter(
    grad_h1: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w13: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    config: W13DgradConfig | None = None,
) -> None:
    """``grad_x_route = bf16(grad_h1 @ W13)`` stored to ``scatter_ptrs[row]`` (module docstring).

    Args:
        grad_h1: bf16 ``[R_act, 2F]`` (``[grad_g | grad_u]``) in activation rows,
            ``R_act >= row_offsets[E_local]``.
        padded_offsets: int32 ``[E_local + 1]``, the expert segments of padded rows (multiples
            of ``config.block_m``).
        row_offsets: int32 ``[E_local + 1]``, exclusive prefix sum of the live rows per expert:
            padded row ``padded_offsets[e] + j`` is live iff ``j < n_e``, at activation row
            ``row_offsets[e] + j``.
        w13: bf16 ``[E_local, 2, F, D]``.
        scatter_ptrs: int64 ``[R_cap]``, indexed by padded row: absolute byte addresses of bf16
            rows of ``D`` values (16-byte aligned; 0 = skip). Only live, non-null rows are
            written; nothing else is touched, and entries of padding rows are not read.
        config: :class:`W13DgradConfig`; ``None`` = ``from_heuristic`` with ``block_m`` 128.
    """
    check_tensor("w13", w13, dtypes=(torch.bfloat16,), ndim=4, shape_text="[E_local, 2, F, D]")
    num_experts, two, ffn, hidden = w13.shape
    if two != 2:
        raise ValueError(f"w13 must have shape [E_local, 2, F, D], got {list(w13.shape)}")
    if num_experts < 1:
        raise ValueError(f"w13 must hold at least one expert, got shape {list(w13.shape)}")
    check_width("D (w13.shape[3])", hidden)
    check_width("F (w13.shape[2])", ffn)
    num_rows = check_row_table("scatter_ptrs", scatter_ptrs)
    check_offsets(padded_offsets, row_offsets, num_experts)
    num_act = check_activation_rows("grad_h1", grad_h1, 2 * ffn, "2F")
    check_tma_aligned("grad_h1", grad_h1)
    check_tma_aligned("w13", w13)
    device = check_devices(
        {
            "grad_h1": grad_h1,
            "padded_offsets": padded_offsets,
            "row_offsets": row_offsets,
            "w13": w13,
            "scatter_ptrs": scatter_ptrs,
        }
    )
    if config is None:
        config = W13DgradConfig.from_heuristic(hidden=hidden, ffn=ffn)
    elif not isinstance(config, W13DgradConfig):
        raise TypeError(f"config must be a W13DgradConfig or None, got {type(config).__name__}")
    check_rows_cap(num_rows, config.block_m)
    reason = w13_dgrad_gluon_reason(config, device, hidden, ffn)
    if num_rows == 0 or num_act == 0:
        return  # no padded rows, or (R_act >= row_offsets[E]) no live rows
    if reason is None:
        from .w2_gluon import launch_gluon_w13_dgrad

        launch_gluon_w13_dgrad(grad_h1, padded_offsets, row_offsets, w13, scatter_ptrs,
                               block_n=config.block_n, stages=config.num_stages,
                               group_m=config.group_m, warps=config.num_warps,
                               lockstep=config.lockstep,
                               expert_groups=config.expert_groups)
        return
    if config.gluon:
        warn_gluon_fallback("w13_dgrad_scatter", reason)
    grad_h1_arg, w13_arg, grad_h1_half, w13_half = grad_h1, w13, grad_h1, w13
    if config.host_descriptors:
        grad_h1_arg = TensorDescriptor(
            grad_h1,
            shape=[num_act, 2 * ffn],
            strides=[2 * ffn, 1],
            block_shape=[config.block_m, config.block_k],
        )
        w13_arg = TensorDescriptor(
            w13,
            shape=[num_experts, 2 * ffn, hidden],
            strides=[2 * ffn * hidden, hidden, 1],
            block_shape=[1, config.block_k, config.block_n],
        )
        if config.pair_tails:
            grad_h1_half = TensorDescriptor(
                grad_h1,
                shape=[num_act, 2 * ffn],
                strides=[2 * ffn, 1],
                block_shape=[config.block_m // 2, config.block_k],
            )
            w13_half = TensorDescriptor(
                w13,
                shape=[num_experts, 2 * ffn, hidden],
                strides=[2 * ffn * hidden, hidden, 1],
                block_shape=[1, config.block_k, config.block_n // 2],
            )
    else:
        ensure_tma_allocator()
    num_tiles_cap = (num_rows // config.block_m) * triton.cdiv(hidden, config.block_n)
    # the tile counter (a memset node in a captured graph)
    next_tile = (torch.zeros(1, dtype=torch.int32, device=device) if config.dynamic
                 else padded_offsets)
    with device_context(device):
        _w13_dgrad_scatter_kernel[(gemm_grid(config, num_tiles_cap, device),)](
            grad_h1_arg,
            grad_h1_half,
            w13_half,
            padded_offsets,
            row_offsets,
            w13_arg,
            scatter_ptrs,
            next_tile,
            num_rows,
            num_act,
            HIDDEN=hidden,
            FFN=ffn,
            NUM_EXPERTS=num_experts,
            EXPERTS_POW2=next_power_of_2(num_experts),
            HOST_DESC=config.host_descriptors,
            PERSISTENT=config.persistent,
            DYNAMIC=config.dynamic,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            PAIR_TAILS=config.pair_tails,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


def w13_wgrad(
    grad_h1: torch.Tensor,
    x_gathered: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    grad_w13: torch.Tensor,
    *,
    x_offset: torch.Tensor | None = None,
    accumulate: bool = True,
    config: WgradConfig | None = None,
    x_rows: torch.Tensor | None = None,
    rows_origin: int = 0,
) -> None:
    """``grad_w13[e] += grad_h1_e^T @ x_e`` over every local expert's activation rows
    ``[row_offsets[e], row_offsets[e+1])`` (fp32, in place; module docstring). With
    ``accumulate=False``: ``grad_w13[e] = ...`` (fp32 accumulation, one rounding to
    grad_w13's dtype, zeros for experts without rows; needs ``config.split_rows == 1``), so
    grad_w13 needs no zero fill and may be bf16.

    Args:
        grad_h1: bf16 ``[R_act, 2F]`` in activation rows (``R_act >= row_offsets[E_local]``).
        x_gathered: the forward's gathered input rows (null rows zeros) in activation rows:
            bf16 ``[R_act, D]`` like ``grad_h1``, or, with ``x_offset``, a 1-D contiguous bf16
            base tensor (16-byte aligned start) with activation row ``a`` at
            ``x_gathered + x_offset[0] + a*D``; only rows ``< row_offsets[E_local]`` are read
            there.
        padded_offsets: int32 ``[E_local + 1]``, validated with the rest of the layout; the row
            walk itself needs only ``row_offsets``.
        row_offsets: int32 ``[E_local + 1]``, exclusive prefix sum of the live rows per expert.
            Rows past an expert's end that its last row step loads are zeroed, so they may
            hold anything, NaN included.
        grad_w13: fp32 ``[E_local, 2, F, D]``, accumulated into (experts without rows
            untouched); fp32 or bf16 with ``accumulate=False``.
        x_offset: optional int64 ``[1]`` device tensor, the bf16 element offset of activation
            row 0 in ``x_gathered`` (a multiple of 8 elements; not checked). The base is left
            out of the overlap check (the rows it covers are known on the device only). With
            ``x_rows``: int64 ``[2]``, that offset and a device switch: 0 reads the rows
            through the table; ``rows_origin`` leaves the table unread and reads activation
            row ``a`` at ``x_gathered + x_offset[0] + a*D`` (rows stored in order, as without
            ``x_rows``; same bits), so that one launch serves a layer either way.
        config: :class:`WgradConfig` (output tile over ``[2F, D]``); ``None`` =
            ``from_heuristic`` with ``block_m`` 128.
        x_rows: optional int64 ``[R_cap]`` (needs ``x_offset`` ``[2]``): the rows are not stored in
            activation order but named by a table of byte addresses by padded row, the table
            the forward's W13 gathered through (0 = a null row, zeros). Activation row ``a``
            of expert ``e`` is then the row whose address is
            ``x_rows[padded_offsets[e] + a - row_offsets[e]]``, moved from ``rows_origin``
            to ``x_gathered + x_offset[0]``: with x's rows kept token-major at that offset
            and the table naming the rows of a buffer at ``rows_origin`` with the same row
            pitch, each row is read in place (no gathered copy; the same bits). Addresses are
            not checked (device values): each must land inside ``x_gathered``.
        rows_origin: an int, the byte address the table's rows are relative to (with
            ``x_rows``).
    """
    out_dtypes = (torch.float32,) if accumulate else (torch.float32, torch.bfloat16)
    check_tensor(
        "grad_w13", grad_w13, dtypes=out_dtypes, ndim=4, shape_text="[E_local, 2, F, D]"
    )
    num_experts, two, ffn, hidden = grad_w13.shape
    if two != 2:
        raise ValueError(f"grad_w13 must have shape [E_local, 2, F, D], got {list(grad_w13.shape)}")
    check_width("D (grad_w13.shape[3])", hidden)
    check_width("F (grad_w13.shape[2])", ffn)
    num_act = check_activation_rows("grad_h1", grad_h1, 2 * ffn, "2F")
    if x_rows is not None:
        if x_offset is None:
            raise ValueError("x_rows needs x_offset (x_gathered is then the base that the "
                             "table's rows are read from), got x_offset=None")
        check_tensor("x_rows", x_rows, dtypes=(torch.int64,), ndim=1,
                     shape_text="[R_cap] (row byte addresses by padded row)")
        if isinstance(rows_origin, bool) or not isinstance(rows_origin, int) \
                or rows_origin < 0 or rows_origin % 16:
            raise ValueError(f"rows_origin must be a non-negative int, a multiple of 16 "
                             f"(16-byte aligned rows), got {rows_origin!r}")
        if hidden % 8:
            raise ValueError(f"x_rows needs D % 8 == 0 (16-byte rows), got D={hidden}")
    elif rows_origin != 0:
        raise ValueError(f"rows_origin is read only with x_rows, got {rows_origin!r} without")
    if x_offset is None:
        check_tensor(
            "x_gathered",
            x_gathered,
            dtypes=(torch.bfloat16,),
            shape=[num_act, hidden],
            shape_text="[R_act, D] like grad_h1 (or a 1-D base with x_offset)",
        )
        check_tma_aligned("x_gathered", x_gathered)
    elif x_rows is not None:
        check_tensor("x_offset", x_offset, dtypes=(torch.int64,), shape=[2],
                     shape_text="[2] with x_rows (x_gathered's row-0 element offset, and 0 or "
                                "rows_origin)")
        check_base_tensor(
            "x_gathered", x_gathered, "x_offset", "row a at x_gathered + x_offset[0] + a*D"
        )
    else:
        check_device_scalar("x_offset", x_offset, "[1] (bf16 element offset of x_gathered's row 0)")
        check_base_tensor(
            "x_gathered", x_gathered, "x_offset", "row a at x_gathered + x_offset[0] + a*D"
        )
    check_offsets(padded_offsets, row_offsets, num_experts)
    check_tma_aligned("grad_h1", grad_h1)
    named = {
        "grad_h1": grad_h1,
        "x_gathered": x_gathered,
        "padded_offsets": padded_offsets,
        "row_offsets": row_offsets,
        "grad_w13": grad_w13,
    }
    if x_offset is not None:
        named["x_offset"] = x_offset
    if x_rows is not None:
        named["x_rows"] = x_rows
    device = check_devices(named)
    if x_offset is not None:
        del named["x_gathered"]  # rows at a device-side offset: not checkable on the host
    check_disjoint(named)
    config = check_wgrad_config(config, out_rows=2 * ffn, out_cols=hidden,
                                accumulate=accumulate)
    launch_grouped_wgrad(
        grad_h1,
        x_gathered,
        row_offsets,
        grad_w13.view(num_experts, 2 * ffn, hidden),
        config,
        device,
        b_offset=x_offset,
        accumulate=accumulate,
        b_rows=x_rows,
        padded_offsets=padded_offsets,
        b_rows_origin=rows_origin,
    )


# --------------------------------------------------------------------------------------------
# References (plain PyTorch; they read the offsets on the host)
# --------------------------------------------------------------------------------------------


def w13_dgrad_scatter_ref(
    grad_h1: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w13: torch.Tensor,
    *,
    num_rows: int,
) -> torch.Tensor:
    """Reference of :func:`w13_dgrad_scatter`: the fp32 ``[R_cap, D]`` rows (``num_rows`` =
    ``R_cap``, indexed by padded row) that the kernel stores (row ``i`` goes to
    ``scatter_ptrs[i]`` unless that is 0); padding and idle rows are zeros (never stored)."""
    num_experts, _, ffn, hidden = w13.shape
    out = torch.zeros(num_rows, hidden, dtype=torch.float32, device=grad_h1.device)
    for e, (pad, act, count) in enumerate(compact_segments(padded_offsets, row_offsets)):
        if count:
            weight = w13[e].reshape(2 * ffn, hidden).float()
            out[pad : pad + count] = grad_h1[act : act + count].float() @ weight
    return out


def w13_wgrad_ref(
    grad_h1: torch.Tensor,
    x_gathered: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    grad_w13: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`w13_wgrad` (``x_gathered`` 2-D in activation rows): returns
    ``grad_w13 + sum`` as a new fp32 tensor."""
    num_experts, _, ffn, hidden = grad_w13.shape
    out = grad_w13.float().clone()
    for e, (_, act, count) in enumerate(compact_segments(padded_offsets, row_offsets)):
        if count:
            rows = slice(act, act + count)
            grad = grad_h1[rows].float().t() @ x_gathered[rows].float()
            out[e] += grad.reshape(2, ffn, hidden)
    return out
