"""Grouped W2 GEMM with a row-scatter epilogue (forward, bf16).

Two row numberings (see :mod:`distmoe.kernels._common`): the *padded* expert-major rows are
the tile schedule and index ``scatter_ptrs``; h2 is in compact *activation* rows. Local
expert ``e`` owns padded rows ``[padded_offsets[e], padded_offsets[e+1])`` and has
``n_e = row_offsets[e+1] - row_offsets[e]`` live rows; padded row ``r = padded_offsets[e] + j``
is live iff ``j < n_e``, and then its activation row is ``a = row_offsets[e] + j``. For every
live row::

    h3 = h2[a] @ w2[e]^T        (fp32 accumulation, rounded to bf16, width D)
    store h3 at byte address scatter_ptrs[r]   (skipped when the address is 0)

Padding rows are never stored (nor their ``scatter_ptrs`` entries read). The destination is
normally the route's slot ``t*K + k`` in the owner rank's combine buffer, possibly in a peer
GPU's memory mapped into this address space. ``enable`` (int32 ``[1]`` on the device) set to
0 makes every program return at once (nothing is written).

Algorithm: one program computes a ``block_m x block_n`` tile of h3. Both operands come through
TMA descriptors (encoded on the host at launch by default, or built on the device:
``W2Config.host_descriptors``): h2 over ``[R_act, F]`` (local, contiguous rows), loaded at
the tile's first activation row ``row_offsets[e] + (tile_row - padded_offsets[e])``, and the
weights over ``w2`` ``[E_local, D, F]`` (out-of-range F/D tiles read zeros). A tile's rows
past the expert's live rows read the next expert's activation rows or, past ``R_act``, TMA's
zero fill; their results are discarded. The epilogue stores each row with plain ``tl.store``
through its own address: a peer reads these rows after a release/acquire signal, and in
Triton 3.6 a later release does not order a TMA store. A tile's expert, its first activation
row and its live row count are found on the device from ``padded_offsets`` and
``row_offsets``; tiles at or beyond ``padded_offsets[E_local]``, tiles of padding rows only
and tiles whose live rows are all skipped do no GEMM work. The grid is sized from ``R_cap``
(or is persistent), never from routed counts.

Memory: nothing is allocated (device-built descriptors: Triton's scratch, 256 bytes per
program).

Sync points: none on the host. The caller signals the destination ranks after the kernel
(or after a kernel boundary); the stores are plain global stores, 16-byte vectors per row.

Requirements (the device-side ones are not checked): D and F multiples of 8; every non-null
scatter address 16-byte aligned; ``R_cap`` a multiple of ``block_m`` and every expert's padded
segment a multiple of ``block_m``; ``row_offsets[0] = 0`` and ``0 <= n_e <=`` the expert's
padded segment length; h2 has ``R_act >= row_offsets[E_local]`` rows (at least 1 is checked)
and starts 16-byte aligned (checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from distmoe.kernels._common import (
    LOCKSTEP_W2_WEIGHT_BYTES,
    GemmConfig,
    activation_segments,
    check_activation_rows,
    check_block_counters,
    check_devices,
    check_offsets,
    check_padded_offsets_host,
    check_row_offsets_host,
    check_tensor,
    check_tma_aligned,
    check_width,
    config_gluon_reason,
    device_context,
    ensure_tma_allocator,
    gemm_grid,
    gluon_device,
    gluon_mid_rows,
    lockstep_rows,
    next_power_of_2,
    swizzle_tile,
    tile_activation_rows,
    tile_expert,
    validate_block_m,
    warn_gluon_fallback,
    write_rows_at,
)

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _w2_tile(
    h2_desc,
    w_desc,
    padded_offsets_ptr,
    row_offsets_ptr,
    scatter_ptrs_ptr,
    pid_m,
    pid_n,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of h3, scattered row by row."""
    NUM_K: tl.constexpr = (FFN + BLOCK_K - 1) // BLOCK_K
    row_start = pid_m * BLOCK_M
    expert = tile_expert(padded_offsets_ptr, row_start, NUM_EXPERTS, EXPERTS_POW2)
    act_start, num_live = tile_activation_rows(
        padded_offsets_ptr, row_offsets_ptr, expert, row_start
    )
    idx = tl.arange(0, BLOCK_M)
    is_live = idx < num_live
    # Destination addresses of the live rows, read first: a tile whose live rows are all
    # skipped (or that has none) does no GEMM. Every address is a multiple of 16 bytes (module
    # requirement); the hint sits on the pointer tensor (on the loaded int64 it is lost at
    # int_to_ptr): 16-byte vector stores.
    dst = tl.load(scatter_ptrs_ptr + row_start + idx, mask=is_live, other=0)
    is_store_row = dst != 0
    if tl.max(is_store_row.to(tl.int32), axis=0) > 0:
        n0 = pid_n * BLOCK_N
        # TMA row coordinate: the tile's first activation row (any row, not a multiple of
        # BLOCK_M). Rows past the live ones are read but never stored.
        a_row = act_start.to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, NUM_K):
            a = h2_desc.load([a_row, k * BLOCK_K])
            b = w_desc.load([expert, n0, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b.T, acc)

        cols = n0 + tl.arange(0, BLOCK_N)
        mask = is_store_row[:, None]
        if not EVEN_N:
            mask = mask & (cols < HIDDEN)[None, :]
        out_rows = tl.multiple_of(dst.to(tl.pointer_type(tl.bfloat16)), 16)
        tl.store(out_rows[:, None] + cols[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _w2_descs(
    h2,
    w2,
    r_act,
    NUM_EXPERTS: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HOST_DESC: tl.constexpr,
):
    """TMA descriptors over h2 ``[R_act, F]`` and w2 ``[E_local, D, F]``: the host-built ones
    passed in, or built on the device (128 bytes of scratch each, a tensormap fence)."""
    if HOST_DESC:
        return h2, w2
    else:
        h2_desc = tl.make_tensor_descriptor(
            h2, shape=[r_act, FFN], strides=[FFN, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        w_desc = tl.make_tensor_descriptor(
            w2,
            shape=[NUM_EXPERTS, HIDDEN, FFN],
            strides=[HIDDEN * FFN, FFN, 1],
            block_shape=[1, BLOCK_N, BLOCK_K],
        )
        return h2_desc, w_desc


@triton.jit
def _w2_scatter_kernel(
    h2,
    padded_offsets_ptr,
    row_offsets_ptr,
    w2,
    scatter_ptrs_ptr,
    enable_ptr,
    r_act,
    num_pid_m,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    HIDDEN: tl.constexpr,
    FFN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    PERSISTENT: tl.constexpr,
    HOST_DESC: tl.constexpr,
    HAS_ENABLE: tl.constexpr,
):
    """``h2`` and ``w2`` are host TMA descriptors (``HOST_DESC``) or the tensors themselves.

    ``enable_ptr`` (``HAS_ENABLE``) is read once per program; without it, a placeholder that
    is never read.
    """
    NUM_PID_N: tl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N
    total_rows = tl.load(padded_offsets_ptr + NUM_EXPERTS)
    if HAS_ENABLE:
        # The device decides whether this launch runs: disabled, every tile is idle.
        total_rows = tl.where(tl.load(enable_ptr) != 0, total_rows, 0)
    if PERSISTENT:
        # Descriptors once per program, reused by every tile it walks. Programs without a
        # tile (a disabled launch, fewer tiles than programs) exit at once.
        num_live_m = total_rows // BLOCK_M
        num_tiles = num_live_m * NUM_PID_N
        tile_id = tl.program_id(0)
        if tile_id < num_tiles:
            h2_desc, w_desc = _w2_descs(
                h2, w2, r_act, NUM_EXPERTS, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, HOST_DESC
            )
            while tile_id < num_tiles:
                pid_m, pid_n = swizzle_tile(tile_id, num_live_m, NUM_PID_N, GROUP_M)
                _w2_tile(
                    h2_desc, w_desc, padded_offsets_ptr, row_offsets_ptr, scatter_ptrs_ptr,
                    pid_m, pid_n, NUM_EXPERTS, EXPERTS_POW2, HIDDEN, FFN, BLOCK_M, BLOCK_N,
                    BLOCK_K, EVEN_N,
                )  # fmt: skip
                tile_id += tl.num_programs(0)
    else:
        pid_m, pid_n = swizzle_tile(tl.program_id(0), num_pid_m, NUM_PID_N, GROUP_M)
        # Idle tiles (beyond the used rows) exit before building descriptors or loading.
        if pid_m * BLOCK_M < total_rows:
            h2_desc, w_desc = _w2_descs(
                h2, w2, r_act, NUM_EXPERTS, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, HOST_DESC
            )
            _w2_tile(
                h2_desc, w_desc, padded_offsets_ptr, row_offsets_ptr, scatter_ptrs_ptr, pid_m,
                pid_n, NUM_EXPERTS, EXPERTS_POW2, HIDDEN, FFN, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N,
            )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class W2Config(GemmConfig):
    """Launch configuration of :func:`w2_scatter` (see :class:`GemmConfig`).

    ``block_n`` counts h3 columns (of D), ``block_k`` steps over F. ``host_descriptors``
    covers the h2 and w2 TMA descriptors.
    """

    #: Run the warp-specialised Gluon kernel (:mod:`distmoe.kernels.w2_gluon`: a producer
    #: warp loads by TMA while two consumer warpgroups compute) where it can run: Hopper,
    #: not the interpreter, ``block_m`` 128, ``block_k`` 64, D a multiple of ``block_n``, F
    #: of 64, a ring that fits (:func:`~distmoe.kernels.w2_gluon.gluon_w2_reason`).
    #: ``num_warps`` counts the MMA warps of one tile: 4 ("ping-pong", ``block_n`` 128: the
    #: consumers take 128 x 128 tiles in turn, each one's stores under the other's MMAs) or
    #: 8 ("cooperative", ``block_n`` 256: both on one 128 x 256 tile, 64 rows each).
    #: Elsewhere the Triton kernel runs this config (with a ``RuntimeWarning`` that says
    #: why). Uses ``num_stages`` and ``group_m``; ``persistent`` and ``host_descriptors`` do
    #: not apply (one program per SM, host descriptors).
    gluon: bool = False
    #: The Gluon kernel's producers start each wave of tiles together (as
    #: :attr:`~distmoe.kernels.w13_gather_swiglu.W13Config.lockstep`): each waits, a bounded
    #: spin on a device counter, until every program has issued the loads of its previous
    #: tile, so the weight tiles that an expert's row blocks share are read from L2. Same
    #: bits; the Triton kernel ignores it. :meth:`hopper_gluon` sets it at 128 to 191 rows
    #: per expert where each expert's W2 weights hold at least 8 MiB.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w13_gather_swiglu.W13Config.expert_groups`): an
    #: expert's tiles are walked column tile by column tile over all its row blocks, so a
    #: row block's h2 rows are read by its column tiles close together in time. Same bits;
    #: the Triton kernel ignores it. :meth:`hopper_gluon` sets it at EP=1 from 128 to 1024
    #: rows per expert (inference and training).
    expert_groups: bool = False

    @classmethod
    def from_heuristic(cls, *, hidden: int, ffn: int, block_m: int = 128,
                       rows_per_expert: int | None = None,
                       device: torch.device | None = None, ep_size: int = 1,
                       num_experts: int | None = None) -> W2Config:
        """Config from the shapes (D = ``hidden``, F = ``ffn``) and the padding multiple.

        Hopper defaults: 128 x 128 x 64 tiles, 8 warps, 4 stages (32 KiB of SMEM per stage),
        group-M 8, one program per tile. Smaller dimensions shrink the tiles. With a
        ``rows_per_expert`` hint (balanced rows per local expert, a shape key) and D >= 256:
        128 x 256 output tiles on a persistent grid, 3 stages when the hint is >= 1024, else
        4. Measured on one H200 (2026-11-29, ``tools/tune_gemm.py``): at T=8192 D=4096 F=2048
        E=32 K=8 1.64 ms against 1.94 for 128 x 128 (a later run: 1.57 persistent, 1.62 one
        program per tile); at T=4096 D=2048 F=768 E=128 K=8 0.244 ms against 0.315 (0.240
        persistent, 0.241 per tile).

        With the hint and a ``device`` where the warp-specialised Gluon kernel runs (Hopper,
        not the interpreter): that kernel where :meth:`hopper_gluon` picks it. ``ep_size``
        (the expert-parallel group) and ``num_experts`` (the local experts: the Gluon
        kernel at 64-127 rows per expert needs it) are passed on; the tile does not depend on
        ``ep_size`` since run 29, the tile order does.
        """
        if rows_per_expert is not None and block_m == 128 and gluon_device(device):
            gluon = cls.hopper_gluon(hidden=hidden, ffn=ffn, rows_per_expert=rows_per_expert,
                                     ep_size=ep_size, num_experts=num_experts)
            if gluon is not None:
                return gluon
        if rows_per_expert is not None and block_m == 128 and hidden >= 256 and ffn >= 64:
            return cls(block_m=block_m, block_n=256, block_k=64, num_warps=8,
                       num_stages=3 if rows_per_expert >= 1024 else 4, group_m=8,
                       persistent=True)
        block_n = min(128, max(16, next_power_of_2(hidden)))
        block_k = min(64, max(16, next_power_of_2(ffn)))
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        per_stage = (block_m + block_n) * block_k * 2
        num_stages = max(2, min(4, (160 * 1024) // per_stage))
        return cls(
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            num_warps=num_warps,
            num_stages=num_stages,
            group_m=8,
        )

    @classmethod
    def hopper_gluon(cls, *, hidden: int, ffn: int, rows_per_expert: int,
                     ep_size: int = 1, num_experts: int | None = None) -> W2Config | None:
        """The Gluon config :meth:`from_heuristic` picks on a Hopper device (padding multiple
        128), or ``None`` where it keeps the Triton kernel: ping-pong 128 x 128 tiles with 6
        stages from 128 rows per expert, and at 64-127 where
        :func:`~distmoe.kernels._common.gluon_mid_rows` holds for the local expert count
        ``num_experts`` (their W2 weights under 2 GiB); where D and F are multiples of 64
        (a partial last column tile where 128 does not divide D), at any ``ep_size`` (above 1
        some rows are stored into peers' memory).

        Measured on one H200 (2026-11-30, docs/performance.md run 28), against the Triton
        kernel's 128 x 256 tiles:

        * the kernel alone (``tools/tune_gemm.py``): 1.452 against 1.485 ms at T=8192
          D=4096 F=2048 E=32 K=8 (2048 rows per expert) and 0.196 against 0.244 at T=4096
          D=2048 F=768 E=128 K=8 (256 rows per expert);
        * the layer, same call: forward 2.7% faster at the first shape and 2-9% at the
          second (noisy), forward+backward 0.6% and 0.7%; at T=4096 D=2048 F=1024 E=64
          K=8 (512 rows per expert) forward 5.6% faster, forward+backward 0.7% slower (one
          round);
        * at 128 rows per expert, timed interleaved in one process (run 29,
          ``tools/ab_interleaved.py``, median of the per-round ratios): the layer forward
          6.9% and 7.1% faster at T=2048 D=2048 F=768 E=128 K=8 (two calls; forward+backward
          1.7%) and 2.7% at T=4096 D=7168 F=2048 E=256 K=8 (forward+backward even, -0.3%).
          Run 28's one-round A/B (+1.6%, -1.1%) had read that as a disagreement;
        * at 96 rows per expert (T=4096 D=4096 F=2048 E=256 K=6) 0.4% slower, so the Triton
          kernel stayed below 128 until run 38: at 64-127 rows per expert, interleaved,
          inference, 0.5-5.7% faster at D=2048 F=768 E=128, D=2048 F=1024 E=64 and D=4096
          F=2048 E=32 (0.3-0.5 GB of W2 weights), 0.6-1.5% slower at D=4096 and 7168,
          F=2048, E=256 (4.3-7.5 GB). Below 64 rows it stays Triton (run 30: 5.5% slower
          at 4 rows per expert of D=4096 F=2048 E=32; run 38: even at 48, 3.3% faster at
          32 of D=2048 F=768 E=128);
        * where 128 does not divide D (a partial last column tile), from 128 rows per expert
          only: at 64 rows per expert it measured 0.8% slower at GPT-OSS-120B (D = F =
          2880, E=128, K=4, T=2048) and 0.9% at GPT-OSS-20B (E=32, T=512), at 128 rows per
          expert 1.9% (120B) and 2.9% (20B) faster forward+backward (one H200, 2026-12-04,
          run 49, ``tools/ab_interleaved.py``, 7-9 rounds);
        * at EP=2 on two H200s (half the rows stored across NVLink), run 28's sequential
          A/B read the layer forward 1.0% slower at the first shape and even at the second;
          timed interleaved (run 29) it is 0.9% faster at the first and 4.2% at the second
          (4 stages there: 5.1%), so it runs at ``ep_size`` > 1 too;
        * with ``lockstep`` at 128 to 191 rows per expert where each expert's W2 weights
          hold at least 8 MiB (:data:`~distmoe.kernels._common.LOCKSTEP_ROWS`): one H100,
          2026-12-05, run 52, interleaved, sampled routing, the layer forward 5.4% faster at
          T=4096 D=7168 F=2048 E=256 K=8 and 2.5% at D = F = 2880 E=128 K=4
          (forward+backward 0.4%), 1.0% slower at T=2048 D=2048 F=768 E=128 K=8 (3 MB per
          expert) and 1.7% at 256 rows per expert (T=4096 there);
        * with ``expert_groups`` at ``ep_size`` 1 from 128 to 1024 rows per expert
          (:data:`~distmoe.kernels._common.EXPERT_GROUPS_W2_ROWS`):
          one H100, 2026-12-06, run 59, interleaved, sampled routing, the layer forward
          1.031x at T=4096 D=7168 F=2048 E=256 K=8 (the kernel reads 7.76 GB from DRAM
          instead of 8.52, Nsight Compute), 1.037x at D=F=2880 E=128 K=4, 1.016x at T=2048
          D=2048 F=768 E=128 K=8, 1.023x at T=4096 there, 1.021x / 1.032x / 1.010x at
          D=2048 F=1024 E=64 K=8 with 1024 / 4096 / 8192 tokens, 1.041x at D=F=2880 E=32
          K=4, 1.013x at T=4096 D=4096 F=2048 E=32 K=8; 0.967x at T=8192 there (2048 rows
          per expert, exact routing). In training too since run 60 (one H100, 2026-12-06):
          the kernel in the first shape's fwd+bwd step 3.10 against 3.37 ms (Nsight
          Compute; 7.76 GB read instead of 8.51), the step 1.011x there in 11 interleaved
          rounds (run 59: 0.984x in 7), 1.009x at D=F=2880 E=128 K=4, 1.000x at OLMoE,
          1.001x at T=4096 D=2048 F=768 E=128 K=8. Not measured at EP > 1 (rows stored into
          peers' memory), so not taken there.
        """
        from ._common import EXPERT_GROUPS_W2_ROWS
        from .w2_gluon import shape_reason

        # the same tile at every EP size (run 29); the expert-group order measured at EP=1
        lo, hi = EXPERT_GROUPS_W2_ROWS
        groups = ep_size == 1 and lo <= rows_per_expert <= hi
        if rows_per_expert < 128 and (hidden % 128 or not gluon_mid_rows(
                rows_per_expert, num_experts, hidden * ffn)):
            return None
        config = cls(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                     group_m=8, persistent=True, gluon=True,
                     lockstep=lockstep_rows(rows_per_expert)
                     and 2 * hidden * ffn >= LOCKSTEP_W2_WEIGHT_BYTES, expert_groups=groups)
        if shape_reason(hidden=hidden, ffn=ffn, block_m=128, block_n=128, block_k=64,
                        stages=6, warps=4) is not None:
            return None
        return config

    @classmethod
    def all_configs(cls, *, block_m: int = 128) -> list[W2Config]:
        """Candidates for a benchmark sweep at one padding multiple (fitting SM90)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128, 256), block_ks=(64, 128),
                         persistent=(False, True))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _check_w2_args(
    h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable, *, for_kernel: bool
) -> tuple[int, int, int, int, int]:
    check_tensor("w2", w2, dtypes=(torch.bfloat16,), ndim=3, shape_text="[E_local, D, F]")
    num_experts, hidden, ffn = w2.shape
    if num_experts < 1:
        raise ValueError(f"w2 must have shape [E_local >= 1, D, F], got {list(w2.shape)}")
    check_width("w2's D (hidden)", hidden)
    check_width("w2's F (ffn)", ffn)
    check_tensor("scatter_ptrs", scatter_ptrs, dtypes=(torch.int64,), ndim=1, shape_text="[R_cap]")
    r_cap = scatter_ptrs.shape[0]
    check_tensor("h2", h2, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_act, F]")
    if h2.shape[1] != ffn:
        raise ValueError(f"h2 must have shape [R_act, F={ffn}] (F from w2), got {list(h2.shape)}")
    r_act = check_activation_rows("h2", h2, r_cap=r_cap)
    check_offsets(padded_offsets, row_offsets, num_experts)
    named = {
        "h2": h2,
        "padded_offsets": padded_offsets,
        "row_offsets": row_offsets,
        "w2": w2,
        "scatter_ptrs": scatter_ptrs,
    }
    if enable is not None:
        check_tensor("enable", enable, dtypes=(torch.int32,), shape=[1], shape_text="(0 = skip)")
        named["enable"] = enable
    check_devices(named, for_kernel=for_kernel)
    if for_kernel:
        check_tma_aligned("h2", h2)
        check_tma_aligned("w2", w2)
    return r_cap, r_act, num_experts, hidden, ffn


def _check_r_cap(r_cap: int, block_m: int) -> None:
    if r_cap % block_m:
        raise ValueError(
            f"R_cap ({r_cap}, rows of scatter_ptrs) must be a multiple of block_m ({block_m})"
        )


def gluon_reason(config: W2Config, device: torch.device, hidden: int, ffn: int) -> str | None:
    """``None`` when ``config`` runs the Gluon kernel on ``device`` at D = ``hidden``, F =
    ``ffn``, else why not (``config.gluon`` False included)."""
    from .w2_gluon import gluon_w2_reason

    return config_gluon_reason(config, gluon_w2_reason, device, hidden, ffn)


def w2_scatter(
    h2: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w2: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    enable: torch.Tensor | None = None,
    config: W2Config | None = None,
    block_m: int | None = None,
    wait: torch.Tensor | None = None,
    need: int = 0,
    programs: int | None = None,
) -> None:
    """h2 @ W2 per expert, each live row's result stored at its own absolute address.

    Args:
        h2: bf16 ``[R_act, F]`` contiguous, 16-byte aligned: the SwiGLU output in compact
            activation rows (``R_act >= row_offsets[E_local]``, >= 1).
        padded_offsets: int32 ``[E_local + 1]`` (device): expert ``e`` owns padded rows
            ``[padded_offsets[e], padded_offsets[e+1])``, each a multiple of ``block_m``
            (the tile schedule).
        row_offsets: int32 ``[E_local + 1]`` (device): exclusive prefix sum of live rows per
            expert; padded row ``padded_offsets[e] + j`` is live iff
            ``j < row_offsets[e+1] - row_offsets[e]``, and reads h2 row ``row_offsets[e] + j``.
        w2: bf16 ``[E_local, D, F]`` contiguous.
        scatter_ptrs: int64 ``[R_cap]`` indexed by padded row: absolute byte address receiving
            the D bf16 values of each row (16-byte aligned; may be a peer's mapped memory),
            0 = skip the row. Entries of padding rows are never read.
        enable: optional int32 ``[1]`` on the device: 0 = every program returns at once
            (nothing is written), anything else = run.
        config: launch configuration; default :meth:`W2Config.from_heuristic`.
        block_m: the padding multiple (default 128); must match ``config.block_m`` if both
            are given.
        wait, need: optional int32 ``[R_cap / 128]`` (device) and an int >= 1, for a W2 run
            beside the W13 that writes h2 (its ``done``, zeroed before both): a tile's loads
            start once ``wait[padded row / 128] >= need`` (acquire, GPU scope; ``need`` =
            :func:`~distmoe.kernels.w13_gather_swiglu.w13_done_count`). The caller makes
            sure that W13 can run meanwhile: its programs and these fit on the device at
            once, and it is launched first (a module loaded while this waits can stall the
            device for good). Gluon kernel only (ValueError elsewhere).
        programs: optional grid of the Gluon kernel (default one program per SM).

    Only live rows with a non-zero address are stored.
    """
    r_cap, r_act, num_experts, hidden, ffn = _check_w2_args(
        h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable, for_kernel=True
    )
    if config is None:
        config = W2Config.from_heuristic(
            hidden=hidden, ffn=ffn, block_m=128 if block_m is None else block_m
        )
    elif not isinstance(config, W2Config):
        raise TypeError(f"config must be a W2Config, got {type(config).__name__}")
    validate_block_m(config, block_m)
    _check_r_cap(r_cap, config.block_m)
    device = h2.device
    check_block_counters("wait", wait, r_cap, device, programs)
    if wait is not None and (isinstance(need, bool) or not isinstance(need, int) or need < 1):
        raise ValueError(f"need must be an int >= 1 with wait, got {need!r}")
    reason = gluon_reason(config, device, hidden, ffn)
    if wait is not None and reason is not None:
        raise ValueError(f"wait needs the Gluon W2 kernel, which does not run here: {reason}")
    if r_cap == 0:
        return

    if reason is None:
        from .w2_gluon import launch_gluon_w2

        launch_gluon_w2(h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable=enable,
                        block_n=config.block_n, stages=config.num_stages,
                        group_m=config.group_m, warps=config.num_warps, programs=programs,
                        wait=wait, need=need, lockstep=config.lockstep,
                        expert_groups=config.expert_groups)
        return
    if config.gluon:
        warn_gluon_fallback("w2_scatter", reason)
    num_pid_m = r_cap // config.block_m
    num_pid_n = triton.cdiv(hidden, config.block_n)
    grid = gemm_grid(config, num_pid_m * num_pid_n, device)
    if config.host_descriptors:
        h2_arg = TensorDescriptor(
            h2, shape=[r_act, ffn], strides=[ffn, 1], block_shape=[config.block_m, config.block_k]
        )
        w2_arg = TensorDescriptor(
            w2,
            shape=[num_experts, hidden, ffn],
            strides=[hidden * ffn, ffn, 1],
            block_shape=[1, config.block_n, config.block_k],
        )
    else:
        h2_arg, w2_arg = h2, w2
        ensure_tma_allocator()
    with device_context(device):
        _w2_scatter_kernel[(grid,)](
            h2_arg,
            padded_offsets,
            row_offsets,
            w2_arg,
            scatter_ptrs,
            padded_offsets if enable is None else enable,  # placeholder: never read
            r_act,
            num_pid_m,
            NUM_EXPERTS=num_experts,
            EXPERTS_POW2=next_power_of_2(num_experts),
            HIDDEN=hidden,
            FFN=ffn,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            EVEN_N=hidden % config.block_n == 0,
            PERSISTENT=config.persistent,
            HOST_DESC=config.host_descriptors,
            HAS_ENABLE=enable is not None,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def w2_scatter_ref(
    h2: torch.Tensor,
    padded_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    w2: torch.Tensor,
    scatter_ptrs: torch.Tensor,
    *,
    enable: torch.Tensor | None = None,
    targets: Sequence[torch.Tensor],
    block_m: int = 128,
) -> None:
    """Plain-PyTorch :func:`w2_scatter` (any device; synchronises; for tests).

    Same arguments and contract; ``enable`` and the layout are read and checked on the host.
    ``targets`` lists the tensors the addresses point into (contiguous bf16, seen as rows of
    D values); each address is resolved to its (tensor, row) on the host. fp32 matmuls,
    results rounded to bf16 like the kernel's.
    """
    r_cap, r_act, _, _, _ = _check_w2_args(
        h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable, for_kernel=False
    )
    _check_r_cap(r_cap, block_m)
    check_padded_offsets_host(padded_offsets, block_m=block_m, r_cap=r_cap)
    check_row_offsets_host(padded_offsets, row_offsets, r_act=r_act)
    if enable is not None and int(enable.item()) == 0:
        return
    for e, (pad_start, act_start, count) in enumerate(
        activation_segments(padded_offsets, row_offsets)
    ):
        if count == 0:
            continue
        h3 = (h2[act_start : act_start + count].float() @ w2[e].float().T).to(torch.bfloat16)
        write_rows_at(scatter_ptrs[pad_start : pad_start + count], h3, targets, name="scatter_ptrs")
