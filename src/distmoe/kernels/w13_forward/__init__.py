"""Gather + W13 + SwiGLU forward: ``config`` (:class:`W13Config`), ``triton`` (the Triton
kernel and :func:`gather_w13_swiglu`), ``gluon`` (the warp-specialised Gluon kernel),
``phases`` (the two-launch row-block order)."""

from distmoe.kernels.w13_forward.config import W13Config
from distmoe.kernels.w13_forward.triton import gather_w13_swiglu, gather_w13_swiglu_ref

__all__ = ["W13Config", "gather_w13_swiglu", "gather_w13_swiglu_ref"]
