"""Launch configuration of the W2 DGRAD + SwiGLU backward (:class:`W2DgradConfig`): the
Triton kernel's tiles and the Gluon kernel's, with ``from_heuristic`` / ``all_configs``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmoe.kernels.base.checks import check_backward_gemm_config
from distmoe.kernels.base.config import GemmConfig, pow2_clamped
from distmoe.kernels.base.rules_legacy import EXPERT_GROUPS_W2_DGRAD_ROWS, w2_dgrad_lockstep
from distmoe.kernels.w2_dgrad import gluon as w2_dgrad_gluon


@dataclass(frozen=True, kw_only=True)
class W2DgradConfig(GemmConfig):
    """Launch configuration of :func:`~distmoe.kernels.w2_dgrad.triton.w2_dgrad_swiglu_bwd` (see
    :class:`GemmConfig`).

    ``block_m`` rows (the padding multiple), ``block_n`` columns of F (each tile writes
    ``block_n`` columns of grad_g and of grad_u), ``block_k`` step over D. ``persistent``: one
    program per SM walking the live tiles (else one program per tile of the ``R_cap`` bound;
    the default until measured on an H200); the gather-once row copy keeps its own grid.
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
    #: With ``gluon``: shared-memory slots per consumer warpgroup (0-4) for the tile's h1
    #: column quarters (g and u, 16 KiB a slot), filled by cp.async: the first ``h1_prefetch``
    #: quarters before the tile's MMAs, each later one as soon as a slot is read, so that the
    #: epilogue does not wait on h1's global loads (docs/performance.md, run 42). The same
    #: bits as 0. Shares the shared memory with the ring: ``num_stages + h1_prefetch`` at most
    #: 6 (32 KiB each).
    h1_prefetch: int = 0
    #: With ``gluon``: 4 or 8 runs the split kernel instead of the ping-pong one: one MMA
    #: warpgroup computes every tile and hands it, as fp32 in shared memory, to an epilogue
    #: partition of this many warps, so the SwiGLU backward runs on more warps beside the
    #: MMAs (docs/performance.md, run 43). 0: the two ping-pong consumers, each running its
    #: own tiles' epilogue. The same bits.
    epilogue_warps: int = 0
    #: With ``epilogue_warps``: fp32 tiles in shared memory (1 or 2, 64 KiB each; with 2 the
    #: MMA warpgroup never waits for the epilogue's reads of the tile before).
    #: ``num_stages + 2 * epilogue_buffers`` at most 7 (the ring's stages are 32 KiB).
    epilogue_buffers: int = 1
    #: With ``epilogue_warps``: the epilogue issues each column quarter's h1 loads one
    #: quarter ahead, the first before it waits for the tile (run 43's profile: the
    #: epilogue warps spent 44% of their cycles waiting on global loads). The same bits;
    #: measured even (kernel 1.005x at T=4096 D=2048 F=768 E=128, 1.001x at T=8192 D=4096,
    #: one H200, 2026-12-01), so off.
    epilogue_early_h1: bool = False
    #: With ``gluon``: the TMA producers start each wave of tiles together (as
    #: :attr:`~distmoe.kernels.w2_forward.config.W2Config.lockstep`): each waits, a bounded spin on
    #: a device counter, until every program has issued the loads of its previous tile, so
    #: that the weight tiles an expert's row blocks share are read from L2 rather than DRAM
    #: again. Same bits; the Triton kernel ignores it. :meth:`from_heuristic` sets it at 96
    #: to 191 rows per expert where the rank's W2 weights total at least 3 GiB.
    lockstep: bool = False
    #: With ``gluon``: the tile order is a group per expert rather than per ``group_m`` row
    #: blocks (as :attr:`~distmoe.kernels.w2_forward.config.W2Config.expert_groups`): an expert's
    #: tiles are walked column tile by column tile over all its row blocks, so a row block's
    #: grad_h3 rows are read by its column tiles close together in time. Same bits; the
    #: Triton kernel ignores it. :meth:`from_heuristic` sets it at 16 to 768 rows per
    #: expert.
    expert_groups: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_backward_gemm_config(self)
        p = self.h1_prefetch
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"h1_prefetch must be an int, got {type(p).__name__} ({p!r})")
        if not 0 <= p <= 4:
            raise ValueError(f"h1_prefetch ({p}) must be in [0, 4] (column quarters of a tile)")
        if p and not self.gluon:
            raise ValueError(f"h1_prefetch ({p}) needs gluon=True (only the Gluon W2 DGRAD "
                             "prefetches h1)")
        if p and self.num_stages + p > 6:
            raise ValueError(f"num_stages + h1_prefetch ({self.num_stages} + {p}) must be at "
                             "most 6: ring stages and h1 slots share the SM's shared memory "
                             "(32 KiB each)")
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
        if self.epilogue_early_h1 and not w:
            raise ValueError("epilogue_early_h1 needs epilogue_warps (4 or 8): only the split "
                             "kernel's epilogue loads h1 ahead")
        if w and p:
            raise ValueError(f"epilogue_warps ({w}) and h1_prefetch ({p}) do not combine: the "
                             "split kernel's epilogue reads h1 from global memory")
        if w and self.num_stages + 2 * b > 7:
            raise ValueError(f"num_stages + 2 * epilogue_buffers ({self.num_stages} + 2 * {b}) "
                             "must be at most 7: ring stages (32 KiB) and fp32 tiles (64 KiB) "
                             "share the SM's shared memory")
        if self.gluon and self.num_stages < 2:
            raise ValueError(f"num_stages ({self.num_stages}) must be at least 2 with gluon=True: "
                             "the Gluon kernels' consumers hold a ring stage until the next "
                             "one's MMA is issued")

    @classmethod
    def from_heuristic(cls, *, hidden: int, ffn: int, block_m: int = 128,
                       rows_per_expert: int | None = None,
                       device: torch.device | None = None,
                       num_experts: int | None = None) -> W2DgradConfig:
        """128 x 128 x 64 tiles, 8 warps, 4 stages (128 KiB of SMEM) at training shapes;
        narrower tiles for narrow F/D. The SwiGLU epilogue needs about 180 registers per
        thread at 8 warps (sm_90 build), so one CTA per SM: the SMEM is there for a deeper
        pipeline.

        With a ``rows_per_expert`` hint (balanced rows per local expert ``T*K*EP/E``, a shape
        key, never a routed count), ``block_m`` 128 and F >= 256: 128 x 256 tiles, 4 stages.
        Measured on one H200 (2026-11-29, ``tools/tune_gemm.py --backward``): at T=8192
        D=4096 F=2048 E=32 K=8 2.23 ms against 2.44 for 128 x 128; at T=4096 D=2048 F=768
        E=128 K=8 0.405 against 0.410 ms. With the epilogue in four column parts (run 12, same
        tool, gather launch included): 2.15 and 0.368 ms.

        With the hint and a ``device`` where the warp-specialised Gluon kernel runs (Hopper,
        not the interpreter, D and F multiples of 64): that kernel (``gluon``), 128 x 128
        tiles, a ring of 5 stages at >= 1024 rows per expert, else 4. Measured on one H200
        (2026-11-29, run 23, ``tools/tune_gemm.py --backward --kernels w2_dgrad``): 1.720 ms
        against 1.801 for the Triton heuristic at T=8192 D=4096 F=2048 E=32 K=8, 0.282 against
        0.295 at T=4096 D=2048 F=768 E=128 K=8. In its split form (``epilogue_warps=8``, one
        fp32 tile buffer): the kernel alone 1.13x (T=8192 D=4096 F=2048 E=32), 1.36x
        (T=4096 D=2048 F=768 E=128), 1.39x (OLMoE) and 1.24x (T=2048) the ping-pong form,
        same bits; the layer's fwd+bwd 4.5% faster at the second (one H200, 2026-12-01,
        docs/performance.md run 43).

        With the local expert count ``num_experts`` too, the Gluon pick's producer runs in
        ``lockstep`` at 96 to 191 rows per expert where the rank's W2 weights
        (``num_experts * D * F`` bf16) total at least 3 GiB
        (:data:`~distmoe.kernels.base.rules_legacy.LOCKSTEP_W2_DGRAD_WEIGHT_BYTES`). The kernel
        alone, one H100, 2026-12-05 (docs/performance.md run 53, sampled routing): 1.05x at
        DeepSeek-V3 (7.5 GB, 128 rows per expert), 1.10x at DeepSeek-V4-Flash (4.3 GB, 96
        rows); 0.995x at GPT-OSS-120B (2.1 GB, 128 rows), 0.95x at T=2048 D=2048 F=768 E=128
        (0.4 GB, 128 rows) and at T=4096 (256 rows).

        The Gluon pick walks its tiles in ``expert_groups`` order at 16 to 768 rows per
        expert (:data:`~distmoe.kernels.base.rules_legacy.EXPERT_GROUPS_W2_DGRAD_ROWS`), at every EP
        size (the kernel reads the rank's own scratch rows). One H100, 2026-12-06, run 60,
        Nsight Compute on the kernel in the layer's fwd+bwd step, sampled routing: 3.34 ->
        3.07 ms at DeepSeek-V3 (128 rows per expert, lockstep too; DRAM reads 9.10 -> 8.38
        GB), 1.80 -> 1.72 ms at DeepSeek-V4-Flash (96 rows, lockstep too), 230 -> 223 us at
        T=2048 D=2048 F=768 E=128 K=8, 325 -> 310 us at T=4096 there, 349 -> 330 us at
        OLMoE, 317 -> 304 us at Qwen3-30B-A3B, 631 -> 570 us at D=F=2880 E=32 K=4 (512
        rows); at 1024 rows 839 -> 855 us (OLMoE, 8192 tokens) and 860 -> 857 us (T=4096
        D=4096 F=2048 E=32, exact routing); 1.76 -> 1.98 ms at 2048 (T=8192 there). The
        layer's fwd+bwd (``tools/ab_interleaved.py``, 5-9 rounds): 1.004-1.014x at 128-512
        rows, 0.969x at 2048. Run 61 (the kernel in the step as above): 3.11 -> 2.83 ms at
        DeepSeek-V3 with T=2048 (64 rows per expert), 2.83 -> 2.74 ms at T=1024 (32), 868 ->
        853 us at GPT-OSS-120B with T=2048 (64), 121 -> 119 us at OLMoE with T=512 (64); the
        step 1.0045x and 1.0023x at the first and third. Run 62 (the same way): 2.71 -> 2.64
        ms at DeepSeek-V3 with T=512 (16 rows), 2.80 -> 2.74 ms at T=768 (24), 487 -> 470 us
        at OLMoE with T=6144 (768), 727 -> 710 us at Qwen3-30B-A3B with T=12288 (768); at
        1024 829 -> 843 us (OLMoE) and 1.49 -> 1.80 ms (Qwen3-30B-A3B); the step even at 16
        and 768 rows (1.0003x, 1.0008x). Not measured at EP > 1, below 16 rows per expert
        or at 769-1023.
        """
        if rows_per_expert is not None and block_m == 128 and device is not None:
            if w2_dgrad_gluon.gluon_w2_dgrad_reason(device, hidden=hidden, ffn=ffn, block_m=128,
                                                    block_n=128, block_k=64) is None:
                lo, hi = EXPERT_GROUPS_W2_DGRAD_ROWS
                return cls(block_m=128, block_n=128, block_k=64,
                           num_stages=5 if rows_per_expert >= 1024 else 4, gluon=True,
                           epilogue_warps=8,
                           lockstep=w2_dgrad_lockstep(rows_per_expert=rows_per_expert,
                                                      num_experts=num_experts, hidden=hidden,
                                                      ffn=ffn),
                           expert_groups=lo <= rows_per_expert <= hi)
        if rows_per_expert is not None and block_m == 128 and ffn >= 256 and hidden >= 64:
            return cls(block_m=block_m, block_n=256, block_k=64, num_warps=8, num_stages=4)
        block_n = pow2_clamped(ffn, 16, 128)
        block_k = pow2_clamped(hidden, 16, 64)
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        return cls(
            block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=4
        )

    @classmethod
    def all_configs(cls, *, hidden: int, ffn: int, block_m: int = 128) -> list[W2DgradConfig]:
        """Tuning candidates that fit an SM90 (shared memory and accumulator registers)."""
        return cls.sweep(block_m=block_m, block_ns=(64, 128, 256), block_ks=(32, 64, 128),
                         num_stages=(2, 3, 4), persistent=(False, True),
                         max_n=pow2_clamped(ffn, 16, 256), max_k=pow2_clamped(hidden, 16, 256))
