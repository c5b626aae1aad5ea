"""Launch configuration of the W13 DGRAD scatter (:class:`W13DgradConfig`): the Triton
kernel's tiles and the Gluon kernel's (the W2 forward's kernel body,
:mod:`distmoe.kernels.w2_forward.gluon`), with ``for_widths`` / ``all_configs``
(:mod:`distmoe.plan` picks the config a layer uses)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from distmoe.kernels.base.checks import check_backward_gemm_config
from distmoe.kernels.base.config import GemmConfig, pow2_clamped


@dataclass(frozen=True, kw_only=True)
class W13DgradConfig(GemmConfig):
    """Launch configuration of :func:`~distmoe.kernels.w13_dgrad.triton.w13_dgrad_scatter` (see
    :class:`GemmConfig`).

    ``block_m`` rows (the padding multiple), ``block_n`` columns of D per tile, ``block_k``
    step over 2F. ``persistent``: one program per SM walking the live tiles (else, the
    default, one program per tile of the ``R_cap`` bound).
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
    #: (:func:`~distmoe.kernels.w13_dgrad.gluon.launch_gluon_w13_dgrad`: a TMA producer warp, two
    #: consumer warpgroups, the same row-scatter epilogue; the weight tiles read N-major as
    #: stored) where it can run: Hopper, not the interpreter, ``block_m`` 128, ``block_k``
    #: 64, D a multiple of ``block_n``, 2F of 64, a ring that fits
    #: (:func:`~distmoe.kernels.w13_dgrad.gluon.gluon_w13_dgrad_reason`). ``num_warps`` counts the
    #: MMA warps of one tile: 4 (ping-pong 128 x 128 tiles) or 8 (cooperative 128 x 256).
    #: Elsewhere the Triton kernel runs this config (with a ``RuntimeWarning`` that says
    #: why). Uses ``num_stages`` and ``group_m``; ``persistent``, ``host_descriptors``,
    #: ``dynamic`` and ``pair_tails`` are the Triton kernel's (the Gluon programs, one per
    #: SM, walk their tiles with a fixed stride and pair no tails).
    gluon: bool = False
    #: The Gluon kernel's producers start each wave of tiles together (as
    #: :attr:`~distmoe.kernels.w2_forward.config.W2Config.lockstep`, on the same kernel): each
    #: waits, a bounded spin on a device counter, until every program has issued the loads
    #: of its previous tile, so that the weight tiles an expert's row blocks share are read
    #: from L2 rather than DRAM again. Same bits; the Triton kernel ignores it.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w2_forward.config.W2Config.expert_groups`, on the same
    #: kernel). Same bits; the Triton kernel ignores it. Picked by :mod:`distmoe.plan`.
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
    def for_widths(cls, *, hidden: int, ffn: int, block_m: int = 128) -> W13DgradConfig:
        """The plain Triton config that fits these widths: tiles of up to 128 D columns and
        64-wide steps over 2F, 8 warps at a full tile, 3 stages. :mod:`distmoe.plan` picks
        the tuned configs."""
        block_n = pow2_clamped(hidden, 16, 128)
        return cls(block_m=block_m, block_n=block_n, block_k=pow2_clamped(2 * ffn, 16, 64),
                   num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3)

    @classmethod
    def all_configs(cls, *, hidden: int, ffn: int, block_m: int = 128) -> list[W13DgradConfig]:
        """Tuning candidates that fit an SM90."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128, 256), block_ks=(32, 64, 128),
                         num_stages=(3, 4, 5), persistent=(False, True),
                         max_n=pow2_clamped(hidden, 16, 256),
                         max_k=pow2_clamped(2 * ffn, 16, 256))
