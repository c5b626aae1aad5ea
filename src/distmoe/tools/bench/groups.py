"""Process groups for the benchmark: a private one-rank group for EP = 1, or torchrun's world.

``MoEContext`` is collective and takes a process group even at EP = 1; the harness creates
that group itself (a one-process ``init_process_group`` over a ``FileStore`` in a temporary
directory), so ``python -m distmoe bench`` needs no launcher on one GPU. Under ``torchrun``
(``WORLD_SIZE`` > 1 in the environment) the default group of all ranks is used: EP = world size.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def default_backend(device: torch.device | str) -> str:
    """``"cpu:gloo,cuda:nccl"`` on CUDA (collectives on either kind of tensor), else ``"gloo"``."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """Whether this process is a rank that ``torch.distributed.run`` started, one of any
    number (its agent sets ``TORCHELASTIC_RUN_ID``; under it a group must join through the
    env:// rendezvous: a store of its own would wait on the agent's), or any launcher that
    sets a world of several ranks."""
    return ("TORCHELASTIC_RUN_ID" in os.environ
            or int(os.environ.get("WORLD_SIZE", "1")) > 1)


@dataclass
class BenchGroup:
    """The group a benchmark runs on and whether the harness must tear it down.

    Attributes:
        group: the process group (``dist.group.WORLD``).
        rank, world_size: this process's rank and the group size (= EP).
        owned: the harness initialised the default group and destroys it in :meth:`close`.
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    owned: bool
    _tmpdir: str | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
            self.owned = False
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def init_single_process_group(device: torch.device | str, backend: str | None = None) -> BenchGroup:
    """A world of one rank over a ``FileStore`` (or the existing default group, not owned)."""
    if dist.is_initialized():
        return BenchGroup(
            group=dist.group.WORLD,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            owned=False,
        )
    tmpdir = tempfile.mkdtemp(prefix="distmoe-bench-")
    store = dist.FileStore(os.path.join(tmpdir, "store"), 1)
    dist.init_process_group(backend or default_backend(device), store=store, rank=0, world_size=1)
    return BenchGroup(group=dist.group.WORLD, rank=0, world_size=1, owned=True, _tmpdir=tmpdir)


def init_torchrun_group(device_type: str) -> tuple[BenchGroup, torch.device]:
    """Join torchrun's world (env:// rendezvous); on CUDA, bind this rank to ``LOCAL_RANK``."""
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            default_backend(device), device_id=device if device.type == "cuda" else None
        )
    group = BenchGroup(
        group=dist.group.WORLD, rank=dist.get_rank(), world_size=dist.get_world_size(), owned=owned
    )
    return group, device
