"""Modules: parameters of a layer, calling the functional layer (:class:`distmoe.MoEContext`)."""
from .experts import MoEExperts

__all__ = ["MoEExperts"]
