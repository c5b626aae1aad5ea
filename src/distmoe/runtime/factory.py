"""The symmetric heap's factory: picks a backend and builds it (kept apart from the base class
in :mod:`distmoe.runtime.heap`, which every backend imports)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cpu_shm import CpuShmHeap
from .cuda_ipc import CudaIpcHeap
from .cuda_symm import CudaSymmHeap, symmetric_memory_usable
from .heap import Backend, SymmetricHeap


def create_heap(group: dist.ProcessGroup | None = None, *, backend: Backend = "auto",
                device: torch.device | str | None = None) -> SymmetricHeap:
    """*Collective.* Create the symmetric heap of ``group`` (default: the world group).

    ``backend="auto"`` picks ``cpu`` when ``device`` is a CPU device (default when CUDA is
    absent), ``cuda_symm`` when every rank has a GPU of its own and symmetric memory is
    available, and ``cuda_ipc`` otherwise (e.g. several ranks sharing one GPU).
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if backend not in ("auto", "cpu", "cuda_ipc", "cuda_symm"):
        raise ValueError(f"backend ({backend!r}) must be 'auto', 'cpu', 'cuda_ipc' or 'cuda_symm'")
    if backend == "auto":
        if device.type == "cpu":
            backend = "cpu"
        else:
            backend = "cuda_symm" if symmetric_memory_usable(group, device) else "cuda_ipc"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs a CPU device, got device {device}")
        return CpuShmHeap(group, device)
    if device.type != "cuda":
        raise ValueError(f"backend {backend!r} needs a CUDA device, got device {device}")
    if backend == "cuda_ipc":
        return CudaIpcHeap(group, device)
    return CudaSymmHeap(group, device)
