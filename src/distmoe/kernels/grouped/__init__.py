"""The standalone grouped GEMM over contiguous row groups (torch._grouped_mm's offsets):
``config`` (:class:`GroupedConfig`), ``triton`` (the Triton kernel, :func:`grouped_gemm`,
its reference). Its WGRAD is :func:`distmoe.kernels.wgrad.launch_grouped_wgrad`."""

from distmoe.kernels.grouped.config import GroupedConfig
from distmoe.kernels.grouped.triton import grouped_gemm, grouped_gemm_ref, num_row_tiles

__all__ = ["GroupedConfig", "grouped_gemm", "grouped_gemm_ref", "num_row_tiles"]
