"""Block-scaled (MXFP8) grouped GEMMs: ``config`` (:class:`ScaledGemmConfig`), ``triton``
(the Triton kernel, :func:`mxfp8_grouped_mm`, and its reference)."""

from distmoe.kernels.scaled.config import ScaledGemmConfig
from distmoe.kernels.scaled.triton import mxfp8_grouped_mm, mxfp8_grouped_mm_ref

__all__ = ["ScaledGemmConfig", "mxfp8_grouped_mm", "mxfp8_grouped_mm_ref"]
