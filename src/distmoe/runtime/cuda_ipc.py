"""CUDA IPC backend: each rank's buffers are ordinary device allocations whose IPC handles are
exchanged over the process group (torch.multiprocessing's tensor reductions).

Unlike symmetric memory, this works when several ranks share one GPU, which is how EP=2 and
EP=4 run on a single GPU in tests. Peers on the same device are reached through the IPC
mapping; peers on other devices need peer access (P2P/NVLink).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import reduce_tensor

from .cuda_common import CudaHeapBase
from .heap import gather_objects, group_barrier


class CudaIpcHeap(CudaHeapBase):
    backend = "cuda_ipc"

    def __init__(self, group, device) -> None:
        self._buffers: dict[str, list[torch.Tensor]] = {}
        super().__init__(group, device)

    def _allocate(self, name: str, size: int) -> list[int]:
        own = torch.zeros(size, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        handles = gather_objects(reduce_tensor(own), self.group, self.world_size)
        views = []
        for r, (rebuild, args) in enumerate(handles):
            views.append(own if r == self.rank else rebuild(*args))
        self._buffers[name] = views
        return [v.data_ptr() for v in views]

    def _peer(self, name: str, rank: int) -> torch.Tensor:
        return self._buffers[name][rank]

    def _close(self) -> None:
        torch.cuda.synchronize(self.device)
        group_barrier(self.group, self.world_size)  # no peer still reads or writes ours
        self._buffers.clear()
