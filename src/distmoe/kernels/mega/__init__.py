"""W13 and W2 in one persistent Gluon kernel (EP > 1 inference): ``gluon``
(:class:`FusedConfig`, :func:`fused_w13_w2`)."""

from distmoe.kernels.mega.gluon import FusedConfig, fused_reason, fused_w13_w2

__all__ = ["FusedConfig", "fused_reason", "fused_w13_w2"]
