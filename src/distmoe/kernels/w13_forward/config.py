"""Launch configuration of the W13 gather + SwiGLU forward (:class:`W13Config`): the Triton
kernel's tiles and the Gluon kernel's, with ``from_heuristic`` / ``hopper_gluon`` /
``all_configs``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmoe.kernels.base.config import GemmConfig, next_power_of_2
from distmoe.kernels.base.gluon import gluon_device
from distmoe.kernels.base.rules_legacy import gluon_mid_rows, lockstep_rows
from distmoe.kernels.w13_forward.gluon import shape_reason, stage_bytes


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
    #: in L2. Same bits; the Triton kernel ignores it. :meth:`hopper_gluon` sets it at 128
    #: to 191 rows per expert.
    lockstep: bool = False
    #: The Gluon kernel's tile order: a group per expert rather than per ``group_m`` row
    #: blocks. An expert's tiles keep their range of tile numbers but are walked column tile
    #: by column tile over all its row blocks, so a row block's column tiles run close
    #: together, for its gathered rows to stay in L2 between them (in group-M 8 order at
    #: DeepSeek-V3's 128 rows per expert they came from DRAM 2.6 times over: performance.md
    #: run 58), and the row blocks that read a weight tile run side by side. Ignored by the
    #: Triton kernel and with a block order (``order``: EP > 1 with the token copy split
    #: around its join). :meth:`hopper_gluon` sets it where it sets ``lockstep`` (for
    #: training too since run 61).
    expert_groups: bool = False

    def smem_bytes(self) -> int:
        if self.gluon:
            return self.num_stages * stage_bytes(self.block_n, self.block_k, self.num_warps)
        return super().smem_bytes()

    def accumulator_regs_per_thread(self) -> int:
        # the Gluon kernel: 128 x 128 fp32 per consumer warpgroup, whatever the tile
        return 128 if self.gluon else super().accumulator_regs_per_thread()

    @classmethod
    def from_heuristic(cls, *, hidden: int, ffn: int, block_m: int = 128,
                       rows_per_expert: int | None = None, training: bool = False,
                       device: torch.device | None = None,
                       num_experts: int | None = None) -> W13Config:
        """Config from the shapes (D = ``hidden``, F = ``ffn``) and the padding multiple.

        Hopper defaults: 128 x 128 x 64 tiles, 8 warps, group-M 8, 3 stages (48 KiB of SMEM
        per stage). Smaller dimensions shrink the tiles. With a ``rows_per_expert`` hint (the
        balanced rows per local expert ``T*K*EP/E``, a shape key, never a routed count): a
        persistent grid with 4 stages, except 3 for training (h1 and x stored too) with long
        expert segments (hint >= 1024); for inference (``training`` False: only h2 is
        stored) with long segments, also the TMA epilogue.
        Measured on one H200 (2026-11-29): at T=8192 D=4096 F=2048 E=32 K=8, persistent/3
        stages 3.23 ms against 3.45 for one program per tile (``tools/tune_gemm.py``); the
        inference layer forward 5.37 ms with 4 stages and the TMA epilogue against 5.55-5.57
        with 3 stages and pointer stores (``python -m distmoe bench``, performance.md run
        19). In training, 4 stages gave nothing at the layer (17.79 against 17.70 ms) and
        the TMA epilogue was slower in the tuner (each store waits for its buffer before the
        next), as it was at T=4096 D=2048 F=768 E=128 K=8 (0.41 against 0.39 ms). At that
        shape persistent/4 stages: 0.393 ms against 0.459 for one program per tile.

        With the hint and a ``device`` where the warp-specialised Gluon kernel runs (Hopper,
        not the interpreter, ``block_m`` 128, F and D multiples of 64): that kernel
        (``gluon``, :meth:`hopper_gluon` says which tile). Measured on one H200 (2026-11-29):

        * performance.md run 24, 128 x 64 ping-pong tiles: layer forward+backward at issue-a
          17.16-17.25 against 17.33-17.44 ms (Triton), inference forward 5.38-5.42 against
          5.50-5.52; at T=4096 D=2048 F=768 E=128 K=8 the training kernel 0.427 against
          0.504 ms in ``tools/tune_gemm.py``, its inference forward even with Triton at the
          layer;
        * run 27, cooperative 128 x 128 tiles (4 stages) against those: the training kernel
          3.03 against 3.42 ms at issue-a and 0.396 against 0.424 at the fine shape, the
          layer 0.7-1.9% faster in all four cases (issue-a and fine, forward and
          forward+backward); at T=4096 D=2048 F=1024 E=64 K=8 the inference forward 10%
          faster than the Triton kernel;
        * run 29, interleaved in one process: the cooperative tile for inference at 128 rows
          per expert too (forward 4-5% faster at two shapes);
        * run 30, interleaved: and for inference below 64 rows per expert (decode, 0.9-3.4%);
        * run 38, interleaved: and for inference at 64-127 rows per expert where the local
          expert count ``num_experts`` is given and their W13 weights total less than 2 GiB
          (:func:`~distmoe.kernels.base.rules_legacy.gluon_mid_rows`).
        """
        if rows_per_expert is not None and block_m == 128 and gluon_device(device):
            gluon = cls.hopper_gluon(hidden=hidden, ffn=ffn,
                                     rows_per_expert=rows_per_expert, training=training,
                                     num_experts=num_experts)
            if gluon is not None:
                return gluon
        block_n = min(128, max(16, next_power_of_2(ffn)))
        block_k = min(64, max(16, next_power_of_2(hidden)))
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        per_stage = (block_m + 2 * block_n) * block_k * 2
        num_stages = max(2, min(4, (160 * 1024) // per_stage))
        persistent = tma_epilogue = False
        if rows_per_expert is not None:
            persistent = True
            long_segments = rows_per_expert >= 1024
            if not (training and long_segments):
                num_stages = max(2, min(4, (200 * 1024) // per_stage))
            tma_epilogue = not training and long_segments
        return cls(
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            num_warps=num_warps,
            num_stages=num_stages,
            group_m=8,
            persistent=persistent,
            tma_epilogue=tma_epilogue,
        )

    @classmethod
    def hopper_gluon(cls, *, hidden: int, ffn: int, rows_per_expert: int,
                     training: bool, num_experts: int | None = None) -> W13Config | None:
        """The Gluon config :meth:`from_heuristic` picks on a Hopper device (padding multiple
        128), or ``None`` where it keeps the Triton kernel: inference at 64-127 rows per
        expert unless :func:`~distmoe.kernels.base.rules_legacy.gluon_mid_rows` holds for the local
        expert count ``num_experts`` (their W13 weights under 2 GiB), and widths the Gluon
        kernel cannot tile.

        The first of these that the kernel can tile (:func:`~distmoe.kernels.w13_forward.gluon.\
shape_reason`):

        * cooperative 128 x 128 tiles (``num_warps`` 8), 4 stages, from 128 rows per expert
          (performance.md run 27, at the layer: faster at 256, 512 and 2048 rows per expert
          in training and inference; at 128, training even at T=2048 D=2048 F=768 E=128 K=8
          and 1.4% faster at T=4096 D=7168 F=2048 E=256 K=8. Inference at 128, timed
          interleaved in one process (run 29, ``tools/ab_interleaved.py``): 4.0-4.2% faster
          at the first shape (two calls) and 5.4% at the second, where run 27's one-round
          A/B read +1.7% and -0.6%; at 96 rows per expert, T=4096 D=4096 F=2048 E=256 K=6,
          1.5% slower); also for inference below 64 rows per expert (decode: a few rows of
          each expert, its weights streamed once). Run 30, interleaved, random routing: the
          layer forward 0.9-3.4% faster in five cases of 1 to 32 rows per expert, T=16 and
          128 at D=4096 F=2048 E=32 K=8 and at D=2048 F=768 E=128 K=8, T=128 at D=7168
          F=2048 E=256 K=8; run 38: at 64-127 rows per expert 1.3-4.5% faster at D=2048
          F=768 E=128, D=2048 F=1024 E=64 and D=4096 F=2048 E=32, even to 2% slower at D=4096
          and 7168, F=2048, E=256 (and E=128 at EP=2): hence the bound on the weights;
        * for training, and for inference with >= 1024 rows per expert: ping-pong 128 x 64
          tiles, 5 stages at >= 1024 rows per expert, else 6 (run 24).

        The cooperative tile runs with ``lockstep`` at 128 to 191 rows per expert
        (:data:`~distmoe.kernels.base.rules_legacy.LOCKSTEP_ROWS`): there a router's histogram gives
        about half the experts a second, nearly empty row block, and programs that drift
        apart read its weight tiles from DRAM again (performance.md run 51). Run 52,
        interleaved, sampled routing, one H100: inference forward 1.22x at T=4096 D=7168
        F=2048 E=256 K=8 (1.07x under exact routing), 1.085x at D=F=2880 E=128 K=4 and
        1.018x at T=2048 D=2048 F=768 E=128 K=8; forward+backward 1.026-1.032x at the
        second and even at the third; at 256 rows per expert (T=4096 at the third's widths)
        the forward 2.8% slower, at 512 and 2048 and at decode (T=64) even to 1.1% slower:
        hence the bound, halfway to 256.

        It also walks its tiles in ``expert_groups`` order there: run 58, interleaved, one
        H100, inference forward 1.034x (sampled) / 1.016x (exact) at T=4096 D=7168 F=2048
        E=256 K=8, 1.058x at D=F=2880 E=128 K=4 (sampled), 1.008x at T=1024 D=2048 F=1024
        E=64 K=8; at 256 and 2048 rows per expert (not taken there) 1.009x and 0.996x. In
        training since run 61 (one H100, 2026-12-06): Nsight Compute on the kernel in the
        first shape's fwd+bwd step 6.28 -> 5.94 ms (DRAM reads 16.65 -> 15.56 GB); the step
        (interleaved, 9-15 rounds) 1.009x / 1.012x sampled and 1.000x exact there, 1.017x /
        1.016x sampled and 1.007x exact at the second; forced on outside the lockstep rows
        0.980-1.008x (fine, OLMoE, 2048 rows per expert), so not taken there.

        Where 128 does not divide F (F a multiple of 64) the cooperative tile's last column
        tile is partial; it is a candidate only where its columns past F are at most 1/16 of
        F (GPT-OSS's 2880: run 49 measured it there).
        """
        long_segments = rows_per_expert >= 1024
        decode = not training and rows_per_expert < 64
        mid = not training and gluon_mid_rows(rows_per_expert, num_experts, 2 * ffn * hidden)
        candidates = []
        # a partial last column tile (128 not dividing F) wastes its columns past F: take the
        # cooperative tile only where that is at most 1/16 of F (GPT-OSS: 64 of 2880)
        coop_waste = -(-ffn // 128) * 128 - ffn
        if (rows_per_expert >= 128 or decode or mid) and 16 * coop_waste <= ffn:
            lockstep = lockstep_rows(rows_per_expert)
            candidates.append(cls(block_m=128, block_n=128, block_k=64, num_warps=8,
                                  num_stages=4, group_m=8, persistent=True, gluon=True,
                                  lockstep=lockstep, expert_groups=lockstep))
        if training or long_segments:
            candidates.append(cls(block_m=128, block_n=64, block_k=64, num_warps=4,
                                  num_stages=5 if long_segments else 6, group_m=8,
                                  persistent=True, gluon=True))
        for config in candidates:
            if shape_reason(hidden=hidden, ffn=ffn, block_m=128, block_n=config.block_n,
                            block_k=64, stages=config.num_stages,
                            warps=config.num_warps) is None:
                return config
        return None

    @classmethod
    def all_configs(cls, *, block_m: int = 128) -> list[W13Config]:
        """Candidates for a benchmark sweep at one padding multiple (fitting SM90)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128), block_ks=(64, 128),
                         persistent=(False, True))
