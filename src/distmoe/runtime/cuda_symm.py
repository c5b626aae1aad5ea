"""CUDA symmetric-memory backend (torch.distributed._symmetric_memory): one GPU per rank,
peers reached over NVLink/P2P. Symmetric memory refuses several ranks on one GPU; the heap
factory then picks the IPC backend."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .cuda_common import CudaHeapBase
from .heap import gather_objects, group_barrier, solo


def symmetric_memory_usable(group, device: torch.device) -> bool:
    """*Collective.* True when symmetric memory imports and every rank has its own GPU."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        ok = False
    else:
        ok = True
    if solo(group):
        return False  # a rendezvous needs a process group: the IPC heap serves one rank
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    props = torch.cuda.get_device_properties(device)
    ident = str(getattr(props, "uuid", device))
    seen = gather_objects((ok, ident), group, world)
    devices = [s[1] for s in seen]
    return all(s[0] for s in seen) and len(set(devices)) == world


class CudaSymmHeap(CudaHeapBase):
    backend = "cuda_symm"
    allocates_through_torch = False  # symm_mem.empty: outside the caching allocator

    def __init__(self, group, device) -> None:
        self._handles: dict[str, tuple[torch.Tensor, object]] = {}
        super().__init__(group, device)

    def _allocate(self, name: str, size: int) -> list[int]:
        import torch.distributed._symmetric_memory as symm_mem

        group = self.group
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            # torch 2.11 deprecates it (a FutureWarning per call: "no need to call this
            # function anymore"); older versions need it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                try:
                    symm_mem.enable_symm_mem_for_group(group.group_name)
                except Exception:  # already enabled or not needed on this torch
                    pass
        own = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(own, group)
        self._handles[name] = (own, handle)
        return [int(p) for p in handle.buffer_ptrs]

    def _peer(self, name: str, rank: int) -> torch.Tensor:
        own, handle = self._handles[name]
        if rank == self.rank:
            return own
        return handle.get_buffer(rank, (own.numel(),), torch.uint8)

    def _close(self) -> None:
        torch.cuda.synchronize(self.device)
        group_barrier(self.group, self.world_size)
        self._handles.clear()
