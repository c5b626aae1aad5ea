"""Launch configuration of the W13 DGRAD scatter (:class:`W13DgradConfig`): the Triton
kernel's tiles and the Gluon kernel's (the W2 forward's kernel body,
:mod:`distmoe.kernels.w2_forward.gluon`), with ``from_heuristic`` / ``hopper_gluon`` /
``all_configs``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from distmoe.kernels.base.checks import check_backward_gemm_config
from distmoe.kernels.base.config import GemmConfig, pow2_clamped
from distmoe.kernels.base.gluon import gluon_device
from distmoe.kernels.base.rules_legacy import (
    EXPERT_GROUPS_W13_DGRAD_ROWS,
    GLUON_MID_ROWS_WEIGHT_BYTES,
)
from distmoe.kernels.w2_forward.gluon import shape_reason

#: the largest W13 weights of one expert (2F x D bf16) for which the heuristic picks the Gluon
#: W13 DGRAD (:meth:`W13DgradConfig.hopper_gluon`): 32 MiB, T=8192 D=4096 F=2048's, where it
#: gained; DeepSeek-V3's 56 MiB lost (docs/performance.md run 44)
GLUON_W13_DGRAD_EXPERT_BYTES = 32 * 1024**2


@dataclass(frozen=True, kw_only=True)
class W13DgradConfig(GemmConfig):
    """Launch configuration of :func:`~distmoe.kernels.w13_dgrad.triton.w13_dgrad_scatter` (see
    :class:`GemmConfig`).

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
        block_n = pow2_clamped(hidden, 16, 128)
        block_k = pow2_clamped(2 * ffn, 16, 64)
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
        :data:`~distmoe.kernels.base.rules_legacy.GLUON_MID_ROWS_WEIGHT_BYTES` (2 GiB), an expert's
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
        (:data:`~distmoe.kernels.base.rules_legacy.EXPERT_GROUPS_W13_DGRAD_ROWS`): one H100,
        2026-12-06, run 59, the layer's fwd+bwd interleaved, 1.043x twice at the second shape
        under sampled routing (1.006x exact), 1.009x at OLMoE (T=4096 D=2048 F=1024 E=64
        K=8, 512 rows per expert); 0.951x at the first shape (2048 rows per expert, exact
        routing, 5 rounds). Run 60 (one H100, 2026-12-06, Nsight Compute on the kernel in
        the fwd+bwd step, sampled routing): 340 -> 324 us at the third shape, 233 -> 215 us
        at OLMoE with 1024 tokens (both 128 rows per expert), 478 -> 382 us at the second,
        505 -> 429 us at OLMoE; 942 -> 956 us there with 8192 tokens (1024 rows per
        expert).
        """
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
                         max_n=pow2_clamped(hidden, 16, 256),
                         max_k=pow2_clamped(2 * ffn, 16, 256))
