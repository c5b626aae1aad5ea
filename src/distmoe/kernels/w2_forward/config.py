"""Launch configuration of the W2 scatter forward (:class:`W2Config`): the Triton kernel's
tiles and the Gluon kernel's, with ``for_widths`` / ``all_configs`` (:mod:`distmoe.plan`
picks the config a layer uses)."""

from __future__ import annotations

from dataclasses import dataclass

from distmoe.kernels.base.config import GemmConfig, next_power_of_2


@dataclass(frozen=True, kw_only=True)
class W2Config(GemmConfig):
    """Launch configuration of :func:`~distmoe.kernels.w2_forward.triton.w2_scatter` (see
    :class:`GemmConfig`).

    ``block_n`` counts h3 columns (of D), ``block_k`` steps over F. ``host_descriptors``
    covers the h2 and w2 TMA descriptors.
    """

    #: Run the warp-specialised Gluon kernel (:mod:`distmoe.kernels.w2_forward.gluon`: a producer
    #: warp loads by TMA while two consumer warpgroups compute) where it can run: Hopper,
    #: not the interpreter, ``block_m`` 128, ``block_k`` 64, D a multiple of ``block_n``, F
    #: of 64, a ring that fits (:func:`~distmoe.kernels.w2_forward.gluon.gluon_w2_reason`).
    #: ``num_warps`` counts the MMA warps of one tile: 4 ("ping-pong", ``block_n`` 128: the
    #: consumers take 128 x 128 tiles in turn, each one's stores under the other's MMAs) or
    #: 8 ("cooperative", ``block_n`` 256: both on one 128 x 256 tile, 64 rows each).
    #: Elsewhere the Triton kernel runs this config (with a ``RuntimeWarning`` that says
    #: why). Uses ``num_stages`` and ``group_m``; ``persistent`` and ``host_descriptors`` do
    #: not apply (one program per SM, host descriptors).
    gluon: bool = False
    #: The Gluon kernel's producers start each wave of tiles together (as
    #: :attr:`~distmoe.kernels.w13_forward.config.W13Config.lockstep`): each waits, a bounded
    #: spin on a device counter, until every program has issued the loads of its previous
    #: tile, so the weight tiles that an expert's row blocks share are read from L2. Same
    #: bits; the Triton kernel ignores it. Picked by :mod:`distmoe.plan`.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w13_forward.config.W13Config.expert_groups`): an
    #: expert's tiles are walked column tile by column tile over all its row blocks, so a
    #: row block's h2 rows are read by its column tiles close together in time. Same bits;
    #: the Triton kernel ignores it. Picked by :mod:`distmoe.plan`.
    expert_groups: bool = False

    @classmethod
    def for_widths(cls, *, hidden: int, ffn: int, block_m: int = 128) -> W2Config:
        """The plain Triton config that fits these widths: 128 x 128 x 64 tiles shrunk to
        D = ``hidden`` (columns) and F = ``ffn`` (reduction), 8 warps at a full tile, as many
        stages (2-4) as fit 160 KiB, one program per tile. :mod:`distmoe.plan` picks the
        tuned configs."""
        block_n = min(128, max(16, next_power_of_2(hidden)))
        block_k = min(64, max(16, next_power_of_2(ffn)))
        per_stage = (block_m + block_n) * block_k * 2
        return cls(block_m=block_m, block_n=block_n, block_k=block_k,
                   num_warps=8 if block_m * block_n >= 128 * 128 else 4,
                   num_stages=max(2, min(4, (160 * 1024) // per_stage)), group_m=8)

    @classmethod
    def all_configs(cls, *, block_m: int = 128) -> list[W2Config]:
        """Candidates for a benchmark sweep at one padding multiple (fitting SM90)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128, 256), block_ks=(64, 128),
                         persistent=(False, True))
