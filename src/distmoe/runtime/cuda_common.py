"""Shared part of the two CUDA heap backends: the device-side barrier on a signal buffer."""

from __future__ import annotations

import torch

from .heap import ALIGNMENT, SymmetricHeap, group_barrier

SIGNAL = "__signal__"


class CudaHeapBase(SymmetricHeap):
    """Adds the signal buffer and the stream-ordered :func:`device_barrier` to a CUDA heap.

    With :attr:`timeout` set, each device barrier gives up after that many seconds and
    records which rank did not arrive in :attr:`_fail` (pinned host memory the kernel
    writes through its address, read here without synchronising); :attr:`failed` then
    describes it, :meth:`barrier` raises, and so does every later layer call of the context
    (:meth:`~distmoe.ops.context.MoEContext.check_open`)."""

    def __init__(self, group, device) -> None:
        super().__init__(group, device)
        from .barrier import FAIL_FIELDS

        self._epoch = torch.zeros(1, dtype=torch.int64, device=device)
        #: the device barriers' failure record (runtime.barrier: flag, rank, epoch, its
        #: slot's value, nanoseconds waited), and a numpy view for reads without torch ops
        self._fail = torch.zeros(FAIL_FIELDS, dtype=torch.int64, pin_memory=True)
        self._fail_view = self._fail.numpy()
        self._failed_text: str | None = None
        bases = self._allocate(SIGNAL, ALIGNMENT)
        self._sizes[SIGNAL] = ALIGNMENT
        self._tables[SIGNAL] = torch.tensor(bases, dtype=torch.int64, device=device)
        self.local(SIGNAL).zero_()
        torch.cuda.synchronize(device)  # set-up only: the zeroed signals precede any barrier
        group_barrier(self.group, self.world_size)

    @property
    def failed(self) -> str | None:
        """Why the heap is unusable: a device barrier that timed out (read from the pinned
        failure record, no synchronisation), else None."""
        if self._failed_text is None and self._fail_view[0]:
            _, missing, epoch, seen, waited_ns = (int(v) for v in self._fail_view)
            self._failed_text = (
                f"rank {self.rank} of {self.world_size}: a device barrier (epoch {epoch}) "
                f"waited {waited_ns / 1e9:.1f} s (timeout {self.timeout} s) for rank "
                f"{missing}, which never arrived (its last barrier: epoch {seen}); a rank "
                "died or hangs, and the layer call whose barrier timed out gave invalid "
                "results")
        return self._failed_text

    @failed.setter
    def failed(self, text: str | None) -> None:
        self._failed_text = text

    def barrier(self) -> None:
        """The device barrier; none on a one-rank group (no peer writes or reads anything,
        and stream order already orders this rank's own work; this saves two kernels per
        forward at EP = 1). RuntimeError once a barrier has timed out (:attr:`failed`)."""
        from .barrier import device_barrier

        self._check_open()
        if self.world_size > 1:
            if self.failed is not None:
                raise RuntimeError(f"MoE layer: {self.failed}. This context is unusable: "
                                   "build a new one (collectively) on the ranks that remain")
            device_barrier(self._tables[SIGNAL], self._epoch, self.rank, self._fail,
                           self.timeout)
