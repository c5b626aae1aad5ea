"""The symmetric heap: named, peer-addressable byte buffers plus barriers (docs/design.md).

Every rank of a process group allocates the same named buffers with the same size. Each rank
can then address every peer's copy: kernels receive an int64 table of the peers' base
addresses (``base_table(name)``, on the rank's device), Python code can take tensor views of a
peer's buffer (``peer_view``). Three backends share this interface:

==============  ==========================================  =============================
backend         memory                                      barrier
==============  ==========================================  =============================
``cpu``         one /dev/shm segment per rank and buffer,   gloo barrier on the host
                mapped by every rank's process
``cuda_ipc``    cudaMalloc'd blocks whose CUDA IPC handles   device-side signal kernel
                are exchanged over the group (ranks may     (stream-ordered, graph-safe)
                share one GPU)
``cuda_symm``   torch.distributed._symmetric_memory          device-side signal kernel
                (one GPU per rank, NVLink/P2P)
==============  ==========================================  =============================

Allocation, ``close`` and peer mapping are collective and happen at set-up time; nothing here
runs on a hot path except :meth:`SymmetricHeap.barrier`, which on CUDA is one tiny kernel with
no host synchronisation (it can be captured in a CUDA graph).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["auto", "cpu", "cuda_ipc", "cuda_symm"]

# Every buffer starts on a 256-byte boundary and its size is rounded up to it, so that 16-byte
# vector stores and TMA descriptors never straddle a misaligned base.
ALIGNMENT = 256


#: the ``group`` argument that names this process alone (a one-rank group of its own, whether
#: or not torch.distributed is initialised)
LOCAL = "local"


def solo(group) -> bool:
    """True for :data:`LOCAL`, and for the default group in a process without
    torch.distributed: one rank of its own, no collective (a single-GPU user need not call
    ``init_process_group``)."""
    return (isinstance(group, str) and group == LOCAL) or (group is None
                                                         and not dist.is_initialized())


def gather_objects(obj, group: dist.ProcessGroup | None, world_size: int) -> list:
    """*Collective.* Every rank's ``obj`` in rank order (``dist.all_gather_object``; just
    ``[obj]`` on a one-rank group, which needs no torch.distributed)."""
    if world_size == 1:
        return [obj]
    out = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def group_barrier(group: dist.ProcessGroup | None, world_size: int) -> None:
    """*Collective.* A host barrier over ``group`` (none on a one-rank group)."""
    if world_size > 1:
        dist.barrier(group=group)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class SymmetricHeap(ABC):
    """Named symmetric buffers of one process group (see the module docstring).

    Attributes:
        group: the process group; every method marked *collective* must be called by all of
            its ranks in the same order.
        rank / world_size: this process's rank in ``group`` and the group size.
        device: where the buffers live (``cpu`` or this rank's CUDA device).
    """

    backend: str
    #: True when this backend's buffers come from torch's caching allocator (and so count in
    #: ``torch.cuda.max_memory_allocated``).
    allocates_through_torch: bool = True
    #: seconds a host barrier waits for every rank before it raises naming the missing ones
    #: (CPU backend; None: the process group's own timeout); on the CUDA backends the seconds
    #: a device barrier waits before it records the rank that did not arrive and gives up
    #: (None: no limit; :mod:`distmoe.runtime.barrier`).
    timeout: float | None = None
    #: why the heap became unusable (a barrier that failed), else None
    failed: str | None = None

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        if solo(group):  # no torch.distributed: this process alone
            self.group, self.rank, self.world_size = None, 0, 1
        else:
            self.group = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        self.device = device
        self._sizes: dict[str, int] = {}
        self._tables: dict[str, torch.Tensor] = {}
        self._closed = False

    # ------------------------------------------------------------------ public interface
    def allocate(self, name: str, num_bytes: int) -> torch.Tensor:
        """*Collective.* Allocate buffer ``name`` of ``num_bytes`` on every rank; returns this
        rank's buffer as a uint8 tensor [num_bytes_rounded] (zero-filled)."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"name ({name!r}) must be a non-empty string")
        if name in self._sizes:
            raise ValueError(f"buffer name ({name!r}) is already allocated on this heap")
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 1:
            raise ValueError(f"num_bytes ({num_bytes!r}) must be a positive int")
        size = round_up(num_bytes, ALIGNMENT)
        sizes = gather_objects((name, size), self._object_group(), self.world_size)
        if any(s != (name, size) for s in sizes):
            raise ValueError(
                f"allocate({name!r}, {num_bytes}) was called with different names or sizes "
                f"across ranks: {sizes}"
            )
        peer_bases = self._allocate(name, size)
        self._sizes[name] = size
        self._tables[name] = torch.tensor(peer_bases, dtype=torch.int64, device=self.device)
        buf = self.local(name)
        buf.zero_()
        self.barrier()
        return buf

    def local(self, name: str) -> torch.Tensor:
        """This rank's buffer ``name`` as uint8 [size]."""
        return self.peer(name, self.rank)

    def peer(self, name: str, rank: int) -> torch.Tensor:
        """Rank ``rank``'s buffer ``name`` as a uint8 [size] tensor mapped in this process.
        Writes through it land in the peer's memory."""
        self._check_open()
        if name not in self._sizes:
            raise KeyError(f"no buffer named {name!r}; allocated: {sorted(self._sizes)}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) must lie in [0, {self.world_size})")
        return self._peer(name, rank)

    def view(self, name: str, rank: int, dtype: torch.dtype, shape: tuple[int, ...],
             byte_offset: int = 0) -> torch.Tensor:
        """Typed view ``shape``/``dtype`` of rank ``rank``'s buffer starting at ``byte_offset``."""
        raw = self.peer(name, rank)
        itemsize = torch.empty((), dtype=dtype).element_size()
        num_bytes = itemsize * int(torch.Size(shape).numel())
        if byte_offset % itemsize or byte_offset + num_bytes > raw.numel():
            raise ValueError(
                f"view of {num_bytes} B at offset {byte_offset} does not fit buffer {name!r} "
                f"({raw.numel()} B) with alignment {itemsize}"
            )
        return raw[byte_offset:byte_offset + num_bytes].view(dtype).view(shape)

    def base_table(self, name: str) -> torch.Tensor:
        """int64 [world_size] on this rank's device: base address of buffer ``name`` on every
        rank, as mapped in this process (what kernels use to address peers)."""
        self._check_open()
        return self._tables[name]

    def size(self, name: str) -> int:
        return self._sizes[name]

    @property
    def names(self) -> list[str]:
        return list(self._sizes)

    @property
    def untracked_bytes(self) -> int:
        """Bytes of this rank's buffers that ``torch.cuda.max_memory_allocated`` does not see
        (symmetric memory has its own allocator); 0 when the backend allocates through torch."""
        return 0 if self.allocates_through_torch else sum(self._sizes.values())

    @abstractmethod
    def barrier(self) -> None:
        """*Collective.* Every rank's writes issued before the barrier (to its own or peers'
        buffers) are visible to every rank after it. On CUDA it is stream-ordered on the
        current stream and does not block the host."""

    def close(self) -> None:
        """*Collective.* Release every buffer (idempotent). Segments and mappings go away;
        tensors obtained from the heap must not be used afterwards (peers no longer see
        them). On the CPU backend such a tensor keeps its own mapping alive until it is freed,
        so a stray use reads stale memory instead of faulting; on the GPU backends the memory
        is released."""
        if self._closed:
            return
        self._closed = True
        self._tables.clear()
        self._close()
        self._sizes.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> SymmetricHeap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ backend hooks
    @abstractmethod
    def _allocate(self, name: str, size: int) -> list[int]:
        """Allocate and map; return the base address of every rank's copy in this process."""

    @abstractmethod
    def _peer(self, name: str, rank: int) -> torch.Tensor: ...

    @abstractmethod
    def _close(self) -> None: ...

    def _object_group(self) -> dist.ProcessGroup:
        return self.group

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
