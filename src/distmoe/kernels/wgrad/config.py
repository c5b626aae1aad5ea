"""Launch configuration of the grouped WGRAD (:class:`WgradConfig`): the Triton kernel's
tiles and the Gluon kernel's, with ``for_widths`` / ``all_configs`` (:mod:`distmoe.plan`
picks the config a layer uses)."""

from __future__ import annotations

from dataclasses import dataclass

from distmoe.kernels.base.config import pow2_clamped


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
            ``block_out_n <= 128``. Faster than the plain Gluon kernel, most under a real
            router's partial steps (evidence: docs/performance.md).
        pingpong: with ``specialized``, ``num_warps`` 4 and ``block_out_m`` 128: two MMA
            warpgroups of 4 warps take the program's tiles in turn (each a whole
            128-row tile), so that one's epilogue (the tile's TMA store) runs under the
            other's MMAs; the same bits. With few rows per expert a tile is only a few row
            steps, so the epilogue is a large share of it.
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
    def for_widths(cls, *, out_rows: int, out_cols: int, block_m: int = 128) -> WgradConfig:
        """The plain Triton config that fits an ``out_rows x out_cols`` gradient per expert:
        output tiles of up to 128 x 128, 8 warps at a full tile, 3 stages.
        :mod:`distmoe.plan` picks the tuned configs."""
        m, n = pow2_clamped(out_rows, 16, 128), pow2_clamped(out_cols, 16, 128)
        return cls(block_m=block_m, block_k=min(64, block_m), block_out_m=m, block_out_n=n,
                   num_warps=8 if m * n >= 128 * 128 else 4, num_stages=3)

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
