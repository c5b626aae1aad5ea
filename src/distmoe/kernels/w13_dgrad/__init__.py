"""W13 DGRAD with a scatter epilogue: ``config`` (:class:`W13DgradConfig`), ``triton`` (the
Triton kernel and :func:`w13_dgrad_scatter`), ``gluon`` (its Gluon launcher, on the kernel body of
:mod:`distmoe.kernels.w2_forward.gluon`)."""

from distmoe.kernels.w13_dgrad.config import W13DgradConfig
from distmoe.kernels.w13_dgrad.triton import w13_dgrad_scatter, w13_dgrad_scatter_ref

__all__ = ["W13DgradConfig", "w13_dgrad_scatter", "w13_dgrad_scatter_ref"]
