"""The grouped WGRAD of both backward GEMMs: ``config`` (:class:`WgradConfig`), ``triton``
(the Triton kernel, :func:`launch_grouped_wgrad`, :func:`w2_wgrad`, :func:`w13_wgrad`),
``gluon`` (the persistent Gluon kernels)."""

from distmoe.kernels.wgrad.config import WgradConfig
from distmoe.kernels.wgrad.triton import (
    launch_grouped_wgrad,
    w2_wgrad,
    w2_wgrad_ref,
    w13_wgrad,
    w13_wgrad_ref,
)

__all__ = ["WgradConfig", "launch_grouped_wgrad", "w2_wgrad", "w2_wgrad_ref", "w13_wgrad",
           "w13_wgrad_ref"]
