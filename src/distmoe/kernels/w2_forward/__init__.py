"""W2 forward with a row-scatter epilogue: ``config`` (:class:`W2Config`), ``triton`` (the
Triton kernel and :func:`w2_scatter`), ``gluon`` (the warp-specialised Gluon kernel, whose body
the W13 DGRAD shares)."""

from distmoe.kernels.w2_forward.config import W2Config
from distmoe.kernels.w2_forward.triton import w2_scatter, w2_scatter_ref

__all__ = ["W2Config", "w2_scatter", "w2_scatter_ref"]
