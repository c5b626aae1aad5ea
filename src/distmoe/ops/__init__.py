"""Layer 5: the context that owns buffers and plan, and the autograd functions."""
from .context import MoEContext

__all__ = ["MoEContext"]
