"""Launch configuration of the grouped WGRAD (:class:`WgradConfig`): the Triton kernel's
tiles and the Gluon kernel's, with ``from_heuristic`` / ``hopper_gluon`` / ``all_configs``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from distmoe.kernels.base.config import pow2_clamped
from distmoe.kernels.base.device import device_memory_bytes
from distmoe.kernels.base.gluon import gluon_device
from distmoe.kernels.base.rules_legacy import wgrad_lockstep, wgrad_wide_tiles


@dataclass(frozen=True, kw_only=True)
class WgradConfig:
    """Launch configuration of the grouped WGRAD (:func:`~distmoe.kernels.wgrad.triton.w2_wgrad`,
    ``w13_wgrad``).

    The GEMM is ``grad_w[e] (+)= A_e^T @ B_e`` over expert ``e``'s activation rows, with ``A``
    ``[R_act, P]`` and ``B`` ``[R_act, Q]`` (W2: P = D, Q = F; W13: P = 2F, Q = D).

    Attributes:
        block_m: padding multiple of the expert segments (same as the DGRAD ``block_m``). The
            compact row walk does not depend on it; it only bounds ``block_k``.
        block_k: activation rows per step of the row loop; power of two in [16, 256] dividing
            ``block_m``. A step may run past its expert's last row (compact rows are not
            padded): the last, partial step of each program is masked.
        block_out_m: rows (P) of the output tile; power of two in [16, 256].
        block_out_n: columns (Q) of the output tile; power of two in [16, 256].
        split_rows: programs sharing one output tile, each taking every ``split_rows``-th
            row step and adding with fp32 atomics; 1 = deterministic read-add-write.
        num_warps: 4 or 8.
        num_stages: software-pipeline depth of the row loop (>= 1).
        host_descriptors: TMA descriptors of both operands encoded on the host at launch
            (True) or built on the device in every program (False).
        gluon: run the persistent, hand-pipelined Gluon kernel
            (:mod:`distmoe.kernels.wgrad.gluon`: one program per SM, one load stream across
            tiles, partial steps zeroed in shared memory) wherever it can run: a Hopper GPU,
            not the interpreter, overwrite mode into a contiguous bf16 output, ``P`` a multiple
            of ``block_out_m``. Elsewhere the Triton kernel runs this config. Needs
            ``split_rows == 1`` and ``block_out_m >= 16 * num_warps``.
        specialized: with ``gluon``, its warp-specialised form (a one-warp TMA producer,
            two warps zeroing each tile's partial last step off the MMA warps' path, no
            branch in their step loop; the same bits). Needs ``gluon`` and
            ``block_out_n <= 128``. 12-15% faster than the plain Gluon kernel at exact
            routing and 17-31% under sampled routing at the T=4096, E=128 and DeepSeek-V3
            shapes (one H200, 2026-11-30, performance.md run 39).
        pingpong: with ``specialized``, ``num_warps`` 4 and ``block_out_m`` 128: two MMA
            warpgroups of 4 warps take the program's tiles in turn (each a whole
            128-row tile), so that one's epilogue (the tile's TMA store) runs under the
            other's MMAs; the same bits. Below 1024 rows per expert a tile is only a few
            row steps, so the epilogue is a large share of it.
        lockstep: with ``specialized``, where B is loaded by TMA (not read through a row
            table, ``w13_wgrad``'s ``x_rows``, which ignores it): the producers start each
            wave of tiles together, counting issued tiles in a zeroed int32 counter
            allocated per launch, so that the waves' A and B rows are read from L2 (the
            forwards' ``lockstep``); the same bits.
    """

    block_m: int = 128
    block_k: int = 64
    block_out_m: int = 128
    block_out_n: int = 128
    split_rows: int = 1
    num_warps: int = 8
    num_stages: int = 4
    host_descriptors: bool = True
    gluon: bool = False
    specialized: bool = False
    pingpong: bool = False
    lockstep: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k", "block_out_m", "block_out_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if not (16 <= value <= 256 and value & (value - 1) == 0):
                raise ValueError(f"{name} ({value}) must be a power of two in [16, 256]")
        if self.block_m % self.block_k:
            raise ValueError(
                f"block_k ({self.block_k}) must divide block_m ({self.block_m}): a row step is "
                "at most one padding multiple"
            )
        for name in ("split_rows", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an int >= 1")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps ({self.num_warps}) must be 4 or 8")
        for name in ("host_descriptors", "gluon", "specialized", "pingpong", "lockstep"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{name} must be a bool, got {type(getattr(self, name)).__name__}"
                )
        if self.gluon and (self.split_rows != 1 or self.block_out_m < 16 * self.num_warps):
            raise ValueError(
                f"gluon=True needs split_rows == 1 (got {self.split_rows}) and block_out_m >= "
                f"16 * num_warps (got {self.block_out_m} and {self.num_warps} warps)"
            )
        if self.specialized and (not self.gluon or self.block_out_n > 128):
            raise ValueError(
                f"specialized=True needs gluon=True (got {self.gluon}) and block_out_n <= 128 "
                f"(got {self.block_out_n})"
            )
        if self.pingpong and (not self.specialized or self.num_warps != 4
                              or self.block_out_m != 128):
            raise ValueError(
                f"pingpong=True needs specialized=True (got {self.specialized}), num_warps == 4 "
                f"(got {self.num_warps}) and block_out_m == 128 (got {self.block_out_m})"
            )
        if self.lockstep and not self.specialized:
            raise ValueError(f"lockstep=True needs specialized=True (got {self.specialized})")

    def smem_bytes(self) -> int:
        """Shared memory of the row-loop pipeline (bf16 A and B tiles of every stage)."""
        return self.num_stages * self.block_k * (self.block_out_m + self.block_out_n) * 2

    def fits_hopper(self) -> bool:
        """Pipeline SMEM <= 200 KiB and at most 128 fp32 accumulator registers per thread."""
        regs = self.block_out_m * self.block_out_n // (32 * self.num_warps)
        return self.smem_bytes() <= 200 * 1024 and regs <= 128

    @classmethod
    def from_heuristic(cls, *, out_rows: int, out_cols: int, block_m: int = 128,
                       rows_per_expert: int | None = None,
                       device: torch.device | None = None,
                       gathered_b: bool = False) -> WgradConfig:
        """64 rows per step, 8 warps. ``rows_per_expert`` is a *shape* hint (the balanced
        rows per local expert, ``T*K*EP/E``), never a routed count. ``gathered_b``: B's rows
        are read through a row address table (``b_rows``; see :meth:`hopper_gluon`).

        On a Hopper ``device`` (and ``out_rows`` >= 128, a multiple of 8) the persistent Gluon
        kernel (``gluon=True``), warp-specialised: 256 x 128 tiles where an expert's
        gradient holds 12 MiB or more (on an H200, from 1024 rows per expert), else 128 x
        128 tiles, 5 stages: for long row loops (hint >= 1024) with wide weights its 8-warp
        form (two warpgroups on one tile), else its ping-pong form (:meth:`hopper_gluon`).
        First measured with 128 x 256 tiles and 3 stages for the long row loops, plain 128 x
        128 otherwise; on one
        H200 (2026-11-29, ``tools/tune_wgrad.py --quick``, docs/performance.md run 15), against
        the Triton configs below: at T=4096 D=2048 F=768 E=128 K=8, balanced routing, W13
        (x at a device offset) 0.418 against 0.555 ms and W2 0.210 against 0.268; at T=8192
        D=4096 F=2048 E=32 K=8, W13 3.14 against 3.34 ms and W2 1.66 against 1.69.

        Elsewhere (no ``device``, the interpreter, other GPUs) the Triton kernel:

        * long row loops (hint >= 1024) with wide weights: 128 x 256 output tiles, 3 stages
          (144 KiB of SMEM, and the TMA-store staging of the epilogue);
        * otherwise 128 x 128 tiles (narrower for narrow weights), 3 stages, so two CTAs fit
          an SM and one's epilogue overlaps the other's loads.

        Measured on one H200 (2026-11-29, ``tools/tune_wgrad.py``, overwrite mode): at T=8192
        D=4096 F=2048 E=32 K=8, 128x256/4 stages 3.18 ms (W13) and 1.58 ms (W2) against 3.74 and
        1.84 for 128x128/4; at T=4096 D=2048 F=768 E=128 K=8, 128x128/3 stages 0.65 and 0.35 ms
        against 0.99 and 0.54 for 4 stages. With the TMA-store epilogue (a later run, same
        tool): 128x256/3 stages 3.24 and 1.59 ms against 3.36 and 1.62 for 4 stages at the
        first shape; 128x128/3 stages 0.634 and 0.337 ms at the second.
        """
        if gluon_device(device):
            gluon = cls.hopper_gluon(out_rows=out_rows, out_cols=out_cols, block_m=block_m,
                                     rows_per_expert=rows_per_expert, gathered_b=gathered_b,
                                     device_memory=device_memory_bytes(device))
            if gluon is not None:
                return gluon
        if rows_per_expert is not None and rows_per_expert >= 1024 and out_rows >= 128 \
                and out_cols >= 256:
            return cls(block_m=block_m, block_k=min(64, block_m), block_out_m=128,
                       block_out_n=256, num_warps=8, num_stages=3)
        block_out_m = pow2_clamped(out_rows, 16, 128)
        block_out_n = pow2_clamped(out_cols, 16, 128)
        num_warps = 8 if block_out_m * block_out_n >= 128 * 128 else 4
        return cls(
            block_m=block_m,
            block_k=min(64, block_m),
            block_out_m=block_out_m,
            block_out_n=block_out_n,
            num_warps=num_warps,
            num_stages=3,
        )

    @classmethod
    def hopper_gluon(cls, *, out_rows: int, out_cols: int, block_m: int = 128,
                     rows_per_expert: int | None = None, gathered_b: bool = False,
                     device_memory: int | None = None) -> WgradConfig | None:
        """The Gluon config :meth:`from_heuristic` picks on a Hopper device (None where the
        Gluon kernel does not apply: ``out_rows`` under 128 or not a multiple of 8,
        ``block_m`` < 64). ``out_rows`` need not be a multiple of the tile: an expert's last
        row block is stored clipped (:func:`~distmoe.kernels.wgrad.gluon.launch_gluon_wgrad`;
        D = 2880 at GPT-OSS).

        With ``gathered_b`` (B's rows copied by address, ``cp.async``, rather than by TMA) and
        ``out_rows`` a multiple of 256: the warp-specialised kernel with 256 x 128 tiles, 8
        MMA warps and 3 stages, which loads each B row once per 256 output rows instead of
        128. Kernel alone, one H200 (2026-12-04, ``tools/tune_wgrad.py --quick --routing
        random``, performance.md run 47): 0.453 against 0.499 ms for the ping-pong 128 x 128
        tiles at T=4096 D=2048 F=768 E=128 K=8 (TMA-fed: 0.401), 3.129 against 3.817 ms for
        the two cooperating warpgroups at T=8192 D=4096 F=2048 E=32 K=8 (TMA-fed: 3.344).

        B loaded by TMA, the same 256 x 128 tiles where one expert's gradient holds at least
        :data:`~distmoe.kernels.base.rules_legacy.WGRAD_WIDE_TILE_EXPERT_BYTES` (12 MiB;
        :func:`~distmoe.kernels.base.rules_legacy.wgrad_wide_tiles`), whatever the rows per expert:
        layer fwd+bwd with both WGRADs so, one H100 (2026-12-05, ``tools/ab_interleaved.py
        --variant wide=wgrad:block_out_m=256,num_warps=8,num_stages=3,pingpong=False``, 9
        rounds, performance.md run 54), sampled / exact routing: DeepSeek-V3 1.049x / 1.081x,
        DeepSeek-V4-Flash 1.132x / 1.097x, GPT-OSS-120B 1.021x (sampled), T=8192 D=4096
        F=2048 E=32 K=8 1.090x / 1.099x; below it OLMoE 0.969x, T=2048 D=2048 F=768 E=128
        1.001x, the same at T=16384 0.991x / 0.994x. On one H200 the last of the first four
        read 16.29 against 16.42 ms (run 47, 7 rounds); the others are unmeasured there.
        From :data:`~distmoe.kernels.base.rules_legacy.WGRAD_LOCKSTEP_EXPERT_BYTES` (48 MiB an expert,
        :func:`~distmoe.kernels.base.rules_legacy.wgrad_lockstep`) their producers run in lockstep:
        DeepSeek-V3's W13 WGRAD (56 MiB) read its inputs from DRAM 4.5 times without it
        (Nsight Compute, E=64) and once with it, alone 8.09 against 5.74 ms at 128 rows per
        expert; the layer 1.050x faster under sampled routing with the W13 WGRAD's on, 1.11x
        under exact routing with both (one H100, 2026-12-06, ``--variant
        ls13=w13_wgrad:lockstep=True``, performance.md run 55); at 28-32 MiB even to 1%
        slower under sampled routing.
        ``device_memory`` (bytes; ``None``: not known): on an HBM3e-class device (an H200,
        :data:`~distmoe.kernels.base.rules_legacy.HBM3E_MEMORY_BYTES`) the 256 x 128 tiles need a
        ``rows_per_expert`` hint of at least 1024 as well
        (:data:`~distmoe.kernels.base.rules_legacy.WGRAD_WIDE_TILE_ROWS_HBM3E`): on one H200 the
        ping-pong tiles below were 2.5-4.8% faster at 96-128 rows per expert (DeepSeek-V3,
        V4-Flash, GPT-OSS-120B), the 256 x 128 tiles 2.8% faster at 2048 (one H200,
        2026-12-06, performance.md run 57).
        Elsewhere, two cooperating warpgroups from 1024 rows per expert with outputs at least
        256 wide, else the ping-pong form."""
        if block_m < 64 or out_rows % 8 or out_rows < 128:
            return None
        wide = cls(block_m=block_m, block_k=64, block_out_m=256, block_out_n=128,
                   num_warps=8, num_stages=3, gluon=True, specialized=True)
        if gathered_b and out_rows % 256 == 0 and out_cols >= 128:
            return wide
        keys = dict(out_rows=out_rows, out_cols=out_cols, rows_per_expert=rows_per_expert,
                    device_memory=device_memory)
        if not gathered_b and wgrad_wide_tiles(**keys):
            return replace(wide, lockstep=wgrad_lockstep(**keys))
        if rows_per_expert is not None and rows_per_expert >= 1024 and out_cols >= 256:
            # the warp-specialised kernel, two warpgroups cooperating on a 128 x 128 tile: the
            # layer fwd+bwd 1.3-1.5% faster than with the plain 128 x 256 one (one H200,
            # 2026-12-01, run 42: T=8192 D=4096 F=2048 E=32 K=8 both routings, 13 rounds;
            # T=16384 D=2048 F=768 E=128 K=8 sampled, 9 rounds; tools/ab_interleaved.py)
            return cls(block_m=block_m, block_k=64, block_out_m=128, block_out_n=128,
                       num_warps=8, num_stages=5, gluon=True, specialized=True)
        return cls(block_m=block_m, block_k=64, block_out_m=128,
                   block_out_n=pow2_clamped(out_cols, 16, 128), num_warps=4, num_stages=5,
                   gluon=True, specialized=True, pingpong=True)

    @classmethod
    def all_configs(cls, *, out_rows: int, out_cols: int, block_m: int = 128) -> list[WgradConfig]:
        """Tuning candidates that fit an SM90."""
        out = []
        for block_out_m in (64, 128, 256):
            for block_out_n in (64, 128, 256):
                for block_k in (32, 64, 128):
                    for num_stages in (3, 4, 5):
                        for split_rows in (1, 2, 4):
                            for num_warps in (4, 8):
                                if block_m % block_k:
                                    continue
                                cfg = cls(
                                    block_m=block_m,
                                    block_k=block_k,
                                    block_out_m=min(block_out_m, pow2_clamped(out_rows, 16, 256)),
                                    block_out_n=min(block_out_n, pow2_clamped(out_cols, 16, 256)),
                                    split_rows=split_rows,
                                    num_warps=num_warps,
                                    num_stages=num_stages,
                                )
                                if cfg.fits_hopper() and cfg not in out:
                                    out.append(cfg)
        return out
