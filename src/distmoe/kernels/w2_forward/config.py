"""Launch configuration of the W2 scatter forward (:class:`W2Config`): the Triton kernel's
tiles and the Gluon kernel's, with ``from_heuristic`` / ``hopper_gluon`` / ``all_configs``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmoe.kernels.base.config import GemmConfig, next_power_of_2
from distmoe.kernels.base.gluon import gluon_device
from distmoe.kernels.base.rules_legacy import (
    EXPERT_GROUPS_W2_ROWS,
    LOCKSTEP_W2_WEIGHT_BYTES,
    gluon_mid_rows,
    lockstep_rows,
)
from distmoe.kernels.w2_forward.gluon import shape_reason


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
    #: bits; the Triton kernel ignores it. :meth:`hopper_gluon` sets it at 128 to 191 rows
    #: per expert where each expert's W2 weights hold at least 8 MiB.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w13_forward.config.W13Config.expert_groups`): an
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
        :func:`~distmoe.kernels.base.rules_legacy.gluon_mid_rows` holds for the local expert count
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
          hold at least 8 MiB (:data:`~distmoe.kernels.base.rules_legacy.LOCKSTEP_ROWS`): one H100,
          2026-12-05, run 52, interleaved, sampled routing, the layer forward 5.4% faster at
          T=4096 D=7168 F=2048 E=256 K=8 and 2.5% at D = F = 2880 E=128 K=4
          (forward+backward 0.4%), 1.0% slower at T=2048 D=2048 F=768 E=128 K=8 (3 MB per
          expert) and 1.7% at 256 rows per expert (T=4096 there);
        * with ``expert_groups`` at ``ep_size`` 1 from 128 to 1024 rows per expert
          (:data:`~distmoe.kernels.base.rules_legacy.EXPERT_GROUPS_W2_ROWS`):
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
