"""Launch configuration of the W2 DGRAD + SwiGLU backward (:class:`W2DgradConfig`): the
Triton kernel's tiles and the Gluon kernel's, with ``for_widths`` / ``all_configs``
(:mod:`distmoe.plan` picks the config a layer uses)."""

from __future__ import annotations

from dataclasses import dataclass

from distmoe.kernels.base.checks import check_backward_gemm_config
from distmoe.kernels.base.config import GemmConfig, pow2_clamped


@dataclass(frozen=True, kw_only=True)
class W2DgradConfig(GemmConfig):
    """Launch configuration of :func:`~distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd` (see
    :class:`GemmConfig`).

    ``block_m`` rows (the padding multiple), ``block_n`` columns of F (each tile writes
    ``block_n`` columns of grad_g and of grad_u), ``block_k`` step over D. ``persistent``: one
    program per SM walking the live tiles (else, the default, one program per tile of the
    ``R_cap`` bound); the gather-once row copy keeps its own grid.
    ``host_descriptors`` covers the w2 and gathered grad_h3 TMA descriptors.
    """

    #: Run the warp-specialised Gluon kernel (:mod:`distmoe.kernels.w2_dgrad.gluon`: a TMA
    #: producer warp and two consumer warpgroups taking tiles in turn, so that one's epilogue
    #: runs under the other's MMAs; or, with ``epilogue_warps``, one MMA warpgroup and an
    #: epilogue partition) where it can run: Hopper, not the interpreter, rows already
    #: gathered (``grad_h3_rows``), 128 x 128 x 64 tiles, D and F multiples of 64.
    #: Elsewhere the Triton kernel runs this config. Uses ``num_stages`` (the load ring, 4-6)
    #: and ``group_m``; ``num_warps``, ``persistent`` and ``host_descriptors`` do not apply.
    gluon: bool = False
    #: With ``gluon``: 4 or 8 runs the split kernel instead of the ping-pong one: one MMA
    #: warpgroup computes every tile and hands it, as fp32 in shared memory, to an epilogue
    #: partition of this many warps, so the SwiGLU backward runs on more warps beside the
    #: MMAs (evidence: docs/performance.md). 0: the two ping-pong consumers, each running its
    #: own tiles' epilogue. The same bits.
    epilogue_warps: int = 0
    #: With ``epilogue_warps``: fp32 tiles in shared memory (1 or 2, 64 KiB each; with 2 the
    #: MMA warpgroup never waits for the epilogue's reads of the tile before).
    #: ``num_stages + 2 * epilogue_buffers`` at most 7 (the ring's stages are 32 KiB).
    epilogue_buffers: int = 1
    #: With ``gluon``: the TMA producers start each wave of tiles together (as
    #: :attr:`~distmoe.kernels.w2_forward.config.W2Config.lockstep`): each waits, a bounded spin on
    #: a device counter, until every program has issued the loads of its previous tile, so
    #: that the weight tiles an expert's row blocks share are read from L2 rather than DRAM
    #: again. Same bits; the Triton kernel ignores it. Picked by :mod:`distmoe.plan`.
    lockstep: bool = False
    #: With ``gluon``: the tile order is a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w2_forward.config.W2Config.expert_groups`): an expert's
    #: tiles are walked column tile by column tile over all its row blocks, so a row block's
    #: grad_h3 rows are read by its column tiles close together in time. Same bits; the
    #: Triton kernel ignores it. Picked by :mod:`distmoe.plan`.
    expert_groups: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_backward_gemm_config(self)
        w, b = self.epilogue_warps, self.epilogue_buffers
        for name, v, allowed in (("epilogue_warps", w, (0, 4, 8)),
                                 ("epilogue_buffers", b, (1, 2))):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
            if v not in allowed:
                raise ValueError(f"{name} ({v}) must be one of {allowed}")
        if w and not self.gluon:
            raise ValueError(f"epilogue_warps ({w}) needs gluon=True (only the Gluon W2 DGRAD "
                             "has an epilogue partition)")
        if w and self.num_stages + 2 * b > 7:
            raise ValueError(f"num_stages + 2 * epilogue_buffers ({self.num_stages} + 2 * {b}) "
                             "must be at most 7: ring stages (32 KiB) and fp32 tiles (64 KiB) "
                             "share the SM's shared memory")
        if self.gluon and self.num_stages < 2:
            raise ValueError(f"num_stages ({self.num_stages}) must be at least 2 with gluon=True: "
                             "the Gluon kernels' consumers hold a ring stage until the next "
                             "one's MMA is issued")

    @classmethod
    def for_widths(cls, *, hidden: int, ffn: int, block_m: int = 128) -> W2DgradConfig:
        """The plain Triton config that fits these widths: tiles of up to 128 F columns and
        64-wide D steps, 8 warps at a full tile, 4 stages. :mod:`distmoe.plan` picks the
        tuned configs."""
        block_n = pow2_clamped(ffn, 16, 128)
        return cls(block_m=block_m, block_n=block_n, block_k=pow2_clamped(hidden, 16, 64),
                   num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=4)

    @classmethod
    def all_configs(cls, *, hidden: int, ffn: int, block_m: int = 128) -> list[W2DgradConfig]:
        """Tuning candidates that fit an SM90 (shared memory and accumulator registers)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128, 256), block_ks=(32, 64, 128),
                         num_stages=(2, 3, 4), persistent=(False, True),
                         max_n=pow2_clamped(ffn, 16, 256), max_k=pow2_clamped(hidden, 16, 256))
