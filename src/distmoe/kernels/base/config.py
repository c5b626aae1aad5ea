"""Launch configuration shared by the grouped GEMMs: :class:`GemmConfig`, which each GEMM
family's config subclasses (``W13Config``, ``W2Config``, ``W2DgradConfig``, ``W13DgradConfig``)
with its own ``for_widths`` / ``all_configs``, and the power-of-two helpers they use."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def pow2_clamped(n: int, low: int, high: int) -> int:
    return min(high, max(low, next_power_of_2(n)))


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Launch configuration of one grouped GEMM (frozen; choose it from shapes only).

    Attributes:
        block_m: rows per tile. Must equal the padding multiple of the expert segments
            (the routing layer pads every expert to a multiple of it); power of two, 16-256.
        block_n: output columns per tile (for W13: per half, i.e. gate and up each get
            ``block_n`` columns); power of two, 16-256.
        block_k: reduction step; power of two, 16-256 (64 = one 128-byte bf16 TMA row).
        num_warps: 4 or 8 (one or two Hopper warpgroups).
        num_stages: software-pipeline depth of the K loop (>= 1).
        group_m: row tiles per group of the group-M swizzle (L2 reuse of weight tiles), >= 1.
        persistent: one program per SM walking the live tiles (device-side tile count), instead
            of one program per tile of the ``R_cap`` bound with idle programs exiting at once.
        host_descriptors: the TMA descriptors are encoded on the host at launch and passed as
            kernel parameters (no device work); False builds them in every program
            (``tl.make_tensor_descriptor``: 128 bytes of scratch and a tensormap fence each,
            through the allocator that :func:`~distmoe.kernels.base.device.ensure_tma_allocator`
            installs).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    persistent: bool = False
    host_descriptors: bool = True

    # bf16 B tiles loaded per K step (W13 loads gate and up: 2).
    _B_TILES = 1
    # fp32 accumulators per tile (W13: gate and up).
    _ACCUMULATORS = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if not (is_power_of_2(value) and 16 <= value <= 256):
                raise ValueError(f"{name} ({value}) must be a power of two in [16, 256]")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps ({self.num_warps}) must be 4 or 8")
        for name in ("num_stages", "group_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an int >= 1")
        for field in dataclasses.fields(self):  # every bool option, the subclasses' too
            if field.type in ("bool", bool):
                value = getattr(self, field.name)
                if not isinstance(value, bool):
                    raise TypeError(f"{field.name} must be a bool, got {type(value).__name__}")

    @classmethod
    def sweep(cls, *, block_m: int, block_ns: Sequence[int], block_ks: Sequence[int],
              num_warps: Sequence[int] = (4, 8), num_stages: Sequence[int] = (2, 3, 4, 5),
              persistent: Sequence[bool] = (False,), max_n: int = 256,
              max_k: int = 256) -> list:
        """Every combination (``block_n``/``block_k`` clamped to ``max_n``/``max_k``, group-M
        8) that constructs and fits an SM90, without repeats, in a stable order."""
        out = []
        for n, k, w, st, pe in itertools.product(block_ns, block_ks, num_warps, num_stages,
                                                 persistent):
            cfg = cls(block_m=block_m, block_n=min(n, max_n), block_k=min(k, max_k),
                      num_warps=w, num_stages=st, group_m=8, persistent=pe)
            if cfg.fits_hopper() and cfg not in out:
                out.append(cfg)
        return out

    def with_grid(self, persistent: bool):
        """This config on a persistent grid or on one program per tile (subclasses drop
        what only one grid takes)."""
        return dataclasses.replace(self, persistent=persistent)

    def smem_bytes(self) -> int:
        """Shared memory of the K-loop pipeline (bf16 A and B tiles of every stage)."""
        per_stage = (self.block_m + self._B_TILES * self.block_n) * self.block_k * 2
        return self.num_stages * per_stage

    def accumulator_regs_per_thread(self) -> int:
        """fp32 accumulator registers per thread (Hopper has 255 per thread in all)."""
        return self._ACCUMULATORS * self.block_m * self.block_n // (32 * self.num_warps)

    def fits_hopper(self) -> bool:
        """Heuristic fit on SM90: pipeline SMEM <= 200 KiB (of 227 KiB, leaving the epilogue
        its scratch) and at most 128 accumulator registers per thread."""
        return self.smem_bytes() <= 200 * 1024 and self.accumulator_regs_per_thread() <= 128


def validate_block_m(config: GemmConfig, block_m: int | None) -> None:
    """``block_m`` given beside ``config`` must agree with it."""
    if block_m is not None and block_m != config.block_m:
        raise ValueError(
            f"block_m ({block_m}) must equal config.block_m ({config.block_m}): both name the "
            "padding multiple of the expert segments"
        )
