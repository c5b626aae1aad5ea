"""CPU backend of the symmetric heap: POSIX shared-memory segments mapped by every rank.

Each rank creates one segment per buffer under /dev/shm, every rank maps every peer's segment
(so each process builds its own int64 table of peer base addresses, exactly as on GPU), and
the creator unlinks its segment as soon as all ranks have mapped it. From then on the memory
lives only as long as the mappings: no file remains in /dev/shm, whether the ranks close the
heap, exit, or die. The only window in which a file exists is between creation and the
mapping barrier; :func:`distmoe.launch` removes leftovers of its ranks (prefix
``DISTMOE_SHM_PREFIX``) after they exit.

Barriers are gloo barriers: on CPU the interpreter's kernels run synchronously, so a host
barrier orders all earlier writes.
"""

from __future__ import annotations

import datetime
import mmap
import os
import re
import sys
import uuid

import torch
import torch.distributed as dist

from .heap import SymmetricHeap, group_barrier

SHM_DIR = "/dev/shm"
PREFIX_ENV = "DISTMOE_SHM_PREFIX"


def shm_prefix() -> str:
    """Name prefix of this process tree's segments (set by :func:`distmoe.launch`)."""
    return os.environ.get(PREFIX_ENV, "distmoe")


class CpuShmHeap(SymmetricHeap):
    backend = "cpu"

    def __init__(self, group, device) -> None:
        super().__init__(group, device)
        token = [uuid.uuid4().hex[:12]]
        if self.world_size > 1:
            dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
        self._token = token[0]
        self._maps: dict[str, list[mmap.mmap]] = {}
        self._views: dict[str, list[torch.Tensor]] = {}

    def _segment_path(self, name: str, rank: int) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        return os.path.join(SHM_DIR, f"{shm_prefix()}-{self._token}-r{rank}-{safe}")

    def _allocate(self, name: str, size: int) -> list[int]:
        own = self._segment_path(name, self.rank)
        fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        maps: list[mmap.mmap] = []
        try:
            group_barrier(self.group, self.world_size)  # every segment exists
            for r in range(self.world_size):
                fd = os.open(self._segment_path(name, r), os.O_RDWR)
                try:
                    maps.append(mmap.mmap(fd, size))
                finally:
                    os.close(fd)
            group_barrier(self.group, self.world_size)  # every rank mapped every segment
        finally:
            # Unlink as early as possible; mappings keep the memory alive.
            try:
                os.unlink(own)
            except FileNotFoundError:
                pass
        views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self._maps[name] = maps
        self._views[name] = views
        return [v.data_ptr() for v in views]

    def _peer(self, name: str, rank: int) -> torch.Tensor:
        return self._views[name][rank]

    def barrier(self) -> None:
        """The host barrier; with :attr:`timeout`, a monitored one that raises on every
        rank (``RuntimeError`` naming the ranks that did not arrive where gloo says, and the
        step: the function that called the barrier) instead of waiting for a dead or hung
        rank; the heap is then unusable (:attr:`failed`)."""
        self._check_open()
        if self.world_size == 1:
            return
        if self.failed is not None:
            raise RuntimeError(f"this heap is unusable: {self.failed}")
        try:
            if self.timeout is None:
                dist.barrier(group=self.group)
            else:
                dist.monitored_barrier(group=self.group, wait_all_ranks=True,
                                       timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            step = sys._getframe(1).f_code.co_name  # where the layer was (error path only)
            reason = " ".join(str(exc).split())[:300]
            self.failed = (f"rank {self.rank} of {self.world_size}: the barrier in {step} "
                           f"failed after at most {self.timeout} s ({reason})")
            raise RuntimeError(f"MoE layer: {self.failed}; a rank died or hangs. This "
                               "context is unusable: build a new one (collectively) on the "
                               "ranks that remain") from exc

    def _close(self) -> None:
        # Tensors handed out may still reference the maps: drop our references only. Each
        # tensor made by torch.frombuffer holds its mmap object, so a mapping is unmapped
        # when its last tensor goes. (mmap.close() would unmap it under such a tensor:
        # torch.frombuffer keeps no buffer export that makes close() refuse, and reading the
        # tensor afterwards is a segmentation fault.)
        self._views.clear()
        self._maps.clear()
