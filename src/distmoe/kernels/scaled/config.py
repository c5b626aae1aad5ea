"""Launch configuration of the MXFP8 grouped GEMM (:class:`ScaledGemmConfig`), with
``for_widths`` / ``all_configs`` like the bf16 families' configs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from distmoe.kernels.base.config import is_power_of_2, next_power_of_2

#: Values per MXFP8 scale along K: the kernel's dot step (one FP8 WGMMA is 32 deep in K).
SCALE_BLOCK = 32


@dataclass(frozen=True, kw_only=True)
class ScaledGemmConfig:
    """Launch configuration of :func:`~distmoe.kernels.scaled.triton.mxfp8_grouped_mm`
    (frozen; choose it from shapes only).

    Attributes:
        block_m: rows per tile; must equal the padding multiple of the expert segments
            (``padded_offsets``); power of two, 16-256.
        block_n: output columns per tile (with SwiGLU: per half, a gate and an up tile of
            ``block_n`` weight rows each); power of two, 32-256 (a tile's columns then cover
            whole 32-row weight scale blocks).
        block_k: K loaded per loop iteration, cut into one dot per scale group along K
            (``block_k / 32`` dots of 32 for MXFP8, ``block_k / 128`` of 128 for 128-wide
            groups; at least one group); power of two, 32-256.
        num_warps: 4 or 8 (one or two Hopper warpgroups).
        num_stages: software-pipeline depth of the K loop (>= 1).
        group_m: row tiles per group of the group-M swizzle (L2 reuse of weight tiles), >= 1.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    #: Run the warp-specialised Gluon kernel (:mod:`distmoe.kernels.scaled.gluon`: a producer
    #: warp loads by TMA, two consumer warpgroups each promote while the other's MMAs run)
    #: where it can run: Hopper, not the interpreter, scales per 128 values of K, the tiles
    #: of :data:`~distmoe.kernels.scaled.gluon.GLUON_SCALED_TILES` (128 x 128 x 128, or
    #: ``block_n`` 64 with SwiGLU; ``num_warps`` 8), a ring depth of
    #: :data:`~distmoe.kernels.scaled.gluon.GLUON_SCALED_STAGES`
    #: (:func:`~distmoe.kernels.scaled.gluon.gluon_scaled_reason`). Elsewhere the Triton
    #: kernel runs this config (with a ``RuntimeWarning`` that says why).
    gluon: bool = False
    #: FP4-weight GEMMs only (:mod:`distmoe.kernels.scaled.nvfp4`): compute each tile
    #: transposed, ``out^T = W x^T``, so that the decoded weight rows are the MMA's M side
    #: (read from registers; ``block_n`` rows, 64 per warpgroup) and the token rows its N side
    #: (``block_m`` >= 16): Hopper's wgmma takes its A operand from registers, its B from
    #: shared memory, so the expanded weights skip the shared-memory round trip, and a few
    #: decode tokens fill N instead of wasting M. The FP8 GEMMs refuse it.
    swap_ab: bool = False
    #: FP4-weight GEMMs only: interleave the decoded even-K and odd-K weight tiles into one
    #: tile in K order (a register permutation), so that each weight tile is one dot over
    #: the activation tile as it lies in memory (contiguous: the pipeliner stages it with the
    #: weight bytes); ``False``: two dots per weight tile, one per parity, over the even and
    #: odd activation columns loaded apart (strided loads the pipeliner does not stage: each
    #: K step waits on them). The same products, summed in another order. The FP8 GEMMs
    #: refuse ``False``.
    interleave_k: bool = True

    def __post_init__(self) -> None:
        for name, low in (("block_m", 16), ("block_n", SCALE_BLOCK), ("block_k", SCALE_BLOCK)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if not (is_power_of_2(value) and low <= value <= 256):
                raise ValueError(f"{name} ({value}) must be a power of two in [{low}, 256]")
        if self.num_warps not in (4, 8) or isinstance(self.num_warps, bool):
            raise ValueError(f"num_warps ({self.num_warps!r}) must be 4 or 8")
        for name in ("gluon", "swap_ab", "interleave_k"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        for name in ("num_stages", "group_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an int >= 1")

    def smem_bytes(self, *, swiglu: bool = False) -> int:
        """Shared memory of the K-loop pipeline: FP8 A and B tiles (1 byte a value) and their
        E8M0 scale bytes, every stage."""
        b_tiles = 2 if swiglu else 1
        per_stage = (self.block_m + b_tiles * self.block_n) * (self.block_k + self.block_k // 32)
        return self.num_stages * per_stage

    def accumulator_regs_per_thread(self, *, swiglu: bool = False) -> int:
        """fp32 registers per thread of the accumulators and the 32-deep partial products that
        are promoted into them (two of each with SwiGLU); Hopper has 255 per thread."""
        tiles = 4 if swiglu else 2
        return tiles * self.block_m * self.block_n // (32 * self.num_warps)

    def fits_hopper(self, *, swiglu: bool = False) -> bool:
        """Heuristic fit on SM90: pipeline SMEM <= 200 KiB and at most 128 registers per thread
        of accumulators plus partial products."""
        return (self.smem_bytes(swiglu=swiglu) <= 200 * 1024
                and self.accumulator_regs_per_thread(swiglu=swiglu) <= 128)

    def launch(self, *, rows: int, k: int, n: int, num_experts: int,
               swiglu: bool) -> tuple[tuple[int], int, dict]:
        """``(grid, num_pid_m, kwargs)`` of a grouped-GEMM launch of this family over ``rows``
        row capacity, K = ``k``, ``n`` weight rows (2F with SwiGLU) and ``num_experts``: a
        1-D grid sized from ``rows`` and the output width, never from routed counts
        (``cdiv(rows, block_m) + E - 1`` row tiles, the most that ``rows`` rows padded per
        expert can fill, by ``cdiv(N_out, block_n)`` column tiles), and the shape and tile
        constexprs plus ``num_warps`` / ``num_stages`` every kernel of the family takes."""
        out_n = n // 2 if swiglu else n
        num_pid_m = -(-rows // self.block_m) + num_experts - 1
        num_pid_n = -(-out_n // self.block_n)
        kwargs = dict(NUM_EXPERTS=num_experts, EXPERTS_POW2=next_power_of_2(num_experts),
                      K=k, N=n, OUT_N=out_n, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                      BLOCK_K=self.block_k, GROUP_M=self.group_m,
                      EVEN_K=k % self.block_k == 0, SWIGLU=swiglu,
                      num_warps=self.num_warps, num_stages=self.num_stages)
        return (num_pid_m * num_pid_n,), num_pid_m, kwargs

    @classmethod
    def for_widths(cls, *, k: int, n: int, swiglu: bool = False, block_m: int = 128,
                   k_group: int = SCALE_BLOCK) -> ScaledGemmConfig:
        """A config that fits these widths: 128 x 128 x 64 tiles (128 x 64 per half with
        SwiGLU, whose two accumulators and partials would not fit the registers at 128)
        shrunk to K = ``k`` and the output width (``n``, or ``n / 2`` with SwiGLU), 8 warps at
        a full tile, as many stages (2-4) as fit 160 KiB. (sm_90 ptxas, 8 warps: 128 x 128 at
        block_k 64 takes 254 registers and no spill, at 128 it spills; SwiGLU 128 x 64: 172.)
        ``k_group``: values per scale along K (32 or 128): block_k is at least one group."""
        out_n = n // 2 if swiglu else n
        block_n = min(64 if swiglu else 128, max(SCALE_BLOCK, next_power_of_2(out_n)))
        block_k = max(k_group, min(64, next_power_of_2(k)))
        num_warps = 8 if block_m * block_n * (2 if swiglu else 1) >= 128 * 128 else 4
        probe = cls(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                    num_stages=1)
        stages = max(2, min(4, (160 * 1024) // probe.smem_bytes(swiglu=swiglu)))
        return cls(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                   num_stages=stages, group_m=8)

    @classmethod
    def all_configs(cls, *, block_m: int = 128, swiglu: bool = False) -> list[ScaledGemmConfig]:
        """Candidates for a benchmark sweep at one padding multiple (fitting SM90), in a stable
        order."""
        out = []
        for n, k, w, st in itertools.product((64, 128, 256), (64, 128, 256), (4, 8),
                                             (2, 3, 4)):
            cfg = cls(block_m=block_m, block_n=n, block_k=k, num_warps=w, num_stages=st)
            if cfg.fits_hopper(swiglu=swiglu):
                out.append(cfg)
        return out
