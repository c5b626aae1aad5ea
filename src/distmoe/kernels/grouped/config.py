"""Launch configuration of the standalone grouped GEMM (:class:`GroupedConfig`): the
forward ``out[rows_e] = a[rows_e] @ W_e`` and its DGRAD, with ``for_shape`` /
``all_configs``."""

from __future__ import annotations

from dataclasses import dataclass

from distmoe.kernels.base.config import GemmConfig, pow2_clamped


@dataclass(frozen=True, kw_only=True)
class GroupedConfig(GemmConfig):
    """Launch configuration of :func:`~distmoe.kernels.grouped.triton.grouped_gemm` (see
    :class:`GemmConfig`).

    ``block_m`` rows per tile (the groups are not padded: a tile holds rows of one group only,
    the group's last tile is partial), ``block_n`` output columns, ``block_k`` reduction
    step, ``group_m`` the group-M swizzle of the row tiles. ``persistent`` is not taken (one
    program per tile of the ``cdiv(M, block_m) + E - 1`` bound); ``host_descriptors``
    covers the TMA descriptors of both operands.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.persistent:
            raise ValueError("persistent=True is not supported by the grouped GEMM (one "
                             "program per row tile of the cdiv(M, block_m) + E - 1 bound)")

    @classmethod
    def for_shape(cls, *, rows: int, groups: int, out_cols: int,
                  reduction: int) -> GroupedConfig:
        """The plain Triton config for ``rows`` rows in ``groups`` groups, ``out_cols`` output
        columns and a ``reduction``-long dot: tiles of up to 128 x 128 x 64, ``block_m`` the
        next power of two of the mean group size (a group's last tile is partial, so smaller
        groups waste less on smaller tiles), each at least 16; 8 warps at a full tile, 3
        stages. Shapes only: no device value is read."""
        m = pow2_clamped(-(-rows // max(groups, 1)), 16, 128)
        n = pow2_clamped(out_cols, 16, 128)
        k = pow2_clamped(reduction, 16, 64)
        return cls(block_m=m, block_n=n, block_k=k,
                   num_warps=8 if m * n >= 128 * 128 else 4, num_stages=3)

    @classmethod
    def all_configs(cls, *, rows: int, groups: int, out_cols: int,
                    reduction: int) -> list[GroupedConfig]:
        """Tuning candidates that fit an SM90 (``block_m`` as :meth:`for_shape`)."""
        return cls.sweep(block_m=pow2_clamped(-(-rows // max(groups, 1)), 16, 128), block_ns=(64, 128, 256),
                         block_ks=(32, 64, 128), max_n=pow2_clamped(out_cols, 16, 256),
                         max_k=pow2_clamped(reduction, 16, 256))
