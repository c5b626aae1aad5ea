"""Block-scaled 8- and 4-bit number formats: MXFP8 and NVFP4 quantisers (docs/numerics.md).

Each quantiser is a Triton kernel (CUDA, or the CPU through Triton's interpreter) with a
plain-PyTorch reference ``*_ref`` that runs anywhere and gives the same bits:

* :func:`mxfp8_quantize` / :func:`mxfp8_dequantize`: E4M3 values, one E8M0 scale per 32 values
  along an axis (:mod:`distmoe.quant.mxfp8`);
* :func:`mxfp8_quantize_weight`: a static weight in 32 x 32 blocks, one qdata for the forward
  and the input-gradient GEMM (:class:`MXFP8Weight`, :mod:`distmoe.quant.mxfp8_weight`);
* :func:`nvfp4_quantize` / :func:`nvfp4_dequantize`: E2M1 values packed two per byte, one E4M3
  scale per 16 values and a float32 global scale per tensor or per row
  (:mod:`distmoe.quant.nvfp4`);
* :func:`fp8_block_quantize` / :func:`fp8_block_quantize_weight`: DeepSeek-V3's block FP8
  (float32 scales per 1 x 128 and 128 x 128 blocks), and :func:`mxfp8_rebase`: MXFP8 with
  one scale per 128 values along K (:mod:`distmoe.quant.fp8_block`);
* :func:`prepare_weights`: a layer's expert weights quantised once for a low-precision
  ``MoEContext`` (:class:`PreparedWeight`, :mod:`distmoe.quant.prepare`).
"""

from .formats import QuantLaunchConfig
from .fp8_block import (
    fp8_block_dequantize,
    fp8_block_quantize,
    fp8_block_quantize_ref,
    fp8_block_quantize_weight,
    mxfp8_rebase,
)
from .mxfp8 import mxfp8_dequantize, mxfp8_quantize, mxfp8_quantize_ref
from .mxfp8_weight import MXFP8Weight, mxfp8_quantize_weight, mxfp8_quantize_weight_ref
from .nvfp4 import nvfp4_dequantize, nvfp4_quantize, nvfp4_quantize_ref
from .prepare import PreparedWeight, prepare_weights

__all__ = [
    "MXFP8Weight",
    "PreparedWeight",
    "QuantLaunchConfig",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "fp8_block_quantize_ref",
    "fp8_block_quantize_weight",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_ref",
    "mxfp8_quantize_weight",
    "mxfp8_quantize_weight_ref",
    "mxfp8_rebase",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "nvfp4_quantize_ref",
    "prepare_weights",
]
