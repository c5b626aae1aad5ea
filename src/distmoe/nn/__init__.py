"""Modules: parameters of a layer, calling the functional layer (:class:`distmoe.MoEContext`,
and :mod:`distmoe.nn.shared_expert` for an optional shared expert beside it)."""
from .experts import MoEExperts

__all__ = ["MoEExperts"]
