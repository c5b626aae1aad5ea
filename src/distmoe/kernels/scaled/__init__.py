"""Block-scaled grouped GEMMs: ``config`` (:class:`ScaledGemmConfig`), ``triton`` (MXFP8
operands, :func:`mxfp8_grouped_mm`, exact or rebased onto 128-wide K groups, and block FP8,
:func:`fp8_block_grouped_mm`, with their references), ``nvfp4`` (NVFP4 weights with bf16
activations, :func:`nvfp4_weight_grouped_mm`, or with FP8 activations,
:func:`nvfp4_weight_fp8_mm`, and their references)."""

from distmoe.kernels.scaled.config import ScaledGemmConfig
from distmoe.kernels.scaled.nvfp4 import (
    mxfp4_weight_grouped_mm,
    nvfp4_weight_config,
    nvfp4_weight_fp8_mm,
    nvfp4_weight_fp8_mm_ref,
    nvfp4_weight_grouped_mm,
    nvfp4_weight_grouped_mm_ref,
)
from distmoe.kernels.scaled.triton import (
    fp8_block_grouped_mm,
    fp8_block_grouped_mm_ref,
    mxfp8_grouped_mm,
    mxfp8_grouped_mm_ref,
)

__all__ = [
    "ScaledGemmConfig",
    "fp8_block_grouped_mm",
    "fp8_block_grouped_mm_ref",
    "mxfp4_weight_grouped_mm",
    "mxfp8_grouped_mm",
    "mxfp8_grouped_mm_ref",
    "nvfp4_weight_config",
    "nvfp4_weight_fp8_mm",
    "nvfp4_weight_fp8_mm_ref",
    "nvfp4_weight_grouped_mm",
    "nvfp4_weight_grouped_mm_ref",
]
