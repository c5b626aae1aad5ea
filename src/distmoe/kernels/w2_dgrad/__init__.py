"""W2 DGRAD with the SwiGLU backward fused into its epilogue: ``config``
(:class:`W2DgradConfig`), ``triton`` (the Triton kernels and :func:`w2_dgrad_swiglu_bwd`),
``gluon`` (the warp-specialised Gluon kernel)."""

from distmoe.kernels.w2_dgrad.config import W2DgradConfig
from distmoe.kernels.w2_dgrad.triton import w2_dgrad_swiglu_bwd, w2_dgrad_swiglu_bwd_ref

__all__ = ["W2DgradConfig", "w2_dgrad_swiglu_bwd", "w2_dgrad_swiglu_bwd_ref"]
