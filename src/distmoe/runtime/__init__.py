"""Layer 1: the symmetric heap (peer-addressable named buffers, base tables, barriers)."""

from .heap import ALIGNMENT, SymmetricHeap, create_heap

__all__ = ["ALIGNMENT", "SymmetricHeap", "create_heap"]
