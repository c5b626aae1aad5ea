"""Shared part of the two CUDA heap backends: the device-side barrier on a signal buffer."""

from __future__ import annotations

import torch

from .heap import ALIGNMENT, SymmetricHeap, group_barrier

SIGNAL = "__signal__"


class CudaHeapBase(SymmetricHeap):
    """Adds the signal buffer and the stream-ordered :func:`device_barrier` to a CUDA heap."""

    def __init__(self, group, device) -> None:
        super().__init__(group, device)
        self._epoch = torch.zeros(1, dtype=torch.int64, device=device)
        bases = self._allocate(SIGNAL, ALIGNMENT)
        self._sizes[SIGNAL] = ALIGNMENT
        self._tables[SIGNAL] = torch.tensor(bases, dtype=torch.int64, device=device)
        self.local(SIGNAL).zero_()
        torch.cuda.synchronize(device)  # set-up only: the zeroed signals precede any barrier
        group_barrier(self.group, self.world_size)

    def barrier(self) -> None:
        """The device barrier; none on a one-rank group (no peer writes or reads anything,
        and stream order already orders this rank's own work; this saves two kernels per
        forward at EP = 1)."""
        from .barrier import device_barrier

        self._check_open()
        if self.world_size > 1:
            device_barrier(self._tables[SIGNAL], self._epoch, self.rank)
