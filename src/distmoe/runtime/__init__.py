"""Layer 1: the symmetric heap (peer-addressable named buffers, base tables, barriers)."""

from .factory import create_heap
from .heap import ALIGNMENT, SymmetricHeap

__all__ = ["ALIGNMENT", "SymmetricHeap", "create_heap"]
