"""Launch configuration of the W13 gather + SwiGLU forward (:class:`W13Config`): the Triton
kernel's tiles and the Gluon kernel's, with ``for_widths`` / ``all_configs``
(:mod:`distmoe.plan` picks the config a layer uses)."""

from __future__ import annotations

from dataclasses import dataclass

from distmoe.kernels.base.config import GemmConfig, next_power_of_2
from distmoe.kernels.w13_forward.gluon import stage_bytes


@dataclass(frozen=True, kw_only=True)
class W13Config(GemmConfig):
    """Launch configuration of :func:`~distmoe.kernels.w13_forward.triton.gather_w13_swiglu` (see
    :class:`GemmConfig`).

    ``block_n`` counts h2 columns: each program loads a gate and an up tile of ``block_n``
    rows of ``w13`` and keeps two fp32 accumulators, so a 128 x 128 tile is a 128 x 256 GEMM
    tile with 128 accumulator registers per thread at 8 warps. ``host_descriptors`` covers
    the weight TMA descriptor.
    """

    _B_TILES = 2
    _ACCUMULATORS = 2

    #: Full tiles of a persistent grid store h2, h1 and x through TMA descriptors that each
    #: program builds once (needs F a multiple of ``block_n``, D of ``block_k`` and 16-byte
    #: aligned outputs; otherwise, and on a grid of one program per tile, every tile keeps
    #: pointer stores).
    tma_epilogue: bool = False
    #: Run the warp-specialised Gluon kernel (:mod:`distmoe.kernels.w13_forward.gluon`: a producer
    #: warpgroup gathers while two consumer warpgroups compute) where it can run: Hopper,
    #: not the interpreter, ``block_m`` 128, ``block_k`` 64, F a multiple of ``block_n``, D
    #: of 64, 16-byte aligned outputs, a ring that fits
    #: (:func:`~distmoe.kernels.w13_forward.gluon.gluon_w13_reason`). ``num_warps`` counts the MMA
    #: warps of one tile: 4 ("ping-pong", ``block_n`` 64 for 128 x 64 tiles or 128 for
    #: 64 x 128: the consumers take tiles in turn, each one's epilogue under the other's
    #: MMAs) or 8 ("cooperative", ``block_n`` 128: both consumers on one 128 x 128 tile, 64
    #: rows each, the epilogue not under MMAs). Mind ``GemmConfig``'s default of 8 warps:
    #: ``block_n`` 64 needs ``num_warps=4``. Elsewhere the Triton kernel runs this config
    #: (with a ``RuntimeWarning`` that says why). Uses ``num_stages`` and ``group_m``;
    #: ``persistent`` does not apply (12 warps, one program per SM).
    gluon: bool = False
    #: The Gluon kernel's producers start each wave of tiles together: each waits (a bounded
    #: spin on a device counter) until every program has issued the loads of its previous
    #: tile. Under a real router's routing, tiles differ in live rows and so in time, and
    #: programs that drift apart no longer find the row blocks and weight tiles they share
    #: in L2. Same bits; the Triton kernel ignores it. Picked by :mod:`distmoe.plan`.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks. An expert's tiles keep their range of tile numbers but are walked column tile
    #: by column tile over all its row blocks, so a row block's column tiles run close
    #: together, for its gathered rows to stay in L2 between them (in group-M order at few
    #: rows per expert they come from DRAM several times over; evidence: docs/performance.md),
    #: and the row blocks that read a weight tile run side by side. Ignored by the Triton
    #: kernel and with a block order (``order``: EP > 1 with the token copy split around its
    #: join). Picked by :mod:`distmoe.plan`, with ``lockstep``.
    expert_groups: bool = False

    def smem_bytes(self) -> int:
        if self.gluon:
            return self.num_stages * stage_bytes(self.block_n, self.block_k, self.num_warps)
        return super().smem_bytes()

    def accumulator_regs_per_thread(self) -> int:
        # the Gluon kernel: 128 x 128 fp32 per consumer warpgroup, whatever the tile
        return 128 if self.gluon else super().accumulator_regs_per_thread()

    @classmethod
    def for_widths(cls, *, hidden: int, ffn: int, block_m: int = 128) -> W13Config:
        """The plain Triton config that fits these widths: 128 x 128 x 64 tiles shrunk to
        D = ``hidden`` and F = ``ffn``, 8 warps at a full tile, as many stages (2-4) as fit
        160 KiB, one program per tile. :mod:`distmoe.plan` picks the tuned configs."""
        block_n = min(128, max(16, next_power_of_2(ffn)))
        block_k = min(64, max(16, next_power_of_2(hidden)))
        per_stage = (block_m + 2 * block_n) * block_k * 2
        return cls(block_m=block_m, block_n=block_n, block_k=block_k,
                   num_warps=8 if block_m * block_n >= 128 * 128 else 4,
                   num_stages=max(2, min(4, (160 * 1024) // per_stage)), group_m=8)

    @classmethod
    def all_configs(cls, *, block_m: int = 128) -> list[W13Config]:
        """Candidates for a benchmark sweep at one padding multiple (fitting SM90)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128), block_ks=(64, 128),
                         persistent=(False, True))
