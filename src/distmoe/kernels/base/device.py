"""Device, grid and launch helpers of every kernel family.

* :func:`ensure_tma_allocator`: device-side TMA descriptors (``tl.make_tensor_descriptor``)
  need a global scratch allocator; this installs one that allocates a torch tensor.
* :func:`device_context`, :func:`num_sms`, :func:`gemm_grid`: where and on how many programs
  a kernel launches (grids are sized from ``R_cap`` only, so launches never read routed
  counts on the host: no synchronisation, CUDA-graph safe).
* :func:`device_memory_bytes`, :func:`config_gluon_reason`, :func:`warn_gluon_fallback`,
  :func:`lockstep_counter`: what the launchers of the Gluon kernels share.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch
import triton

from distmoe.kernels.base.config import GemmConfig
from distmoe.kernels.base.interpreter import interpreter_active

# Programs of a persistent grid when kernels run on the CPU interpreter: small, so that tests
# cover programs that walk several tiles.
_INTERPRETER_NUM_SMS = 3


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Triton launches on the current device (launchers enter ``torch.cuda.device``), so the
    # scratch belongs there. Allocated through torch's caching allocator: stream-ordered, and
    # inside CUDA-graph capture it comes from the graph's private pool. torch's CUDA blocks are
    # 512-byte aligned, above the 128 bytes a TMA descriptor needs.
    del alignment, stream
    if torch.cuda.is_available() and not interpreter_active():
        return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())
    return torch.empty(size, dtype=torch.int8)


def ensure_tma_allocator() -> None:
    """Install a torch-backed Triton scratch allocator unless one is already set.

    Kernels that build TMA descriptors on the device need 128 bytes of global scratch per
    descriptor and program. ``triton.set_allocator`` is a per-thread context variable, so this
    runs before every launch; an allocator that the caller installed is kept.
    """
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # private API moved: install ours unconditionally
        pass
    triton.set_allocator(_torch_scratch)


def device_context(device: torch.device):
    """Context in which Triton launches on ``device``."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small fixed number on the interpreter)."""
    if device.type != "cuda" or interpreter_active():
        return _INTERPRETER_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


def gemm_grid(config: GemmConfig, num_tiles_cap: int, device: torch.device) -> int:
    """Programs of a GEMM launch: one per tile of the capacity bound, or one per SM."""
    if config.persistent:
        return max(1, min(num_tiles_cap, num_sms(device)))
    return num_tiles_cap


def device_memory_bytes(device: torch.device | str | None) -> int | None:
    """Total memory of CUDA ``device`` in bytes (``None`` for no device or a CPU one): the
    device-model key of :func:`distmoe.plan.device_class`. Read from the
    driver's cached properties, no synchronisation."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def config_gluon_reason(config: GemmConfig, kernel_reason: Callable[..., str | None],
                        device: torch.device, hidden: int, ffn: int) -> str | None:
    """``None`` when ``config`` (a grouped-GEMM config with a ``gluon`` field) runs its Gluon
    kernel on ``device`` at D = ``hidden``, F = ``ffn``, else why not (``config.gluon`` False
    included): ``kernel_reason`` is the kernel module's ``gluon_*_reason`` check, given the
    config's tile, ring depth and warps."""
    if not config.gluon:
        return "the config asks for the Triton kernel"
    return kernel_reason(device, hidden=hidden, ffn=ffn, block_m=config.block_m,
                         block_n=config.block_n, block_k=config.block_k,
                         stages=config.num_stages, warps=config.num_warps)


def warn_gluon_fallback(kernel: str, reason: str) -> None:
    """A config asked for a Gluon kernel (``gluon=True``) that cannot run this call: say why,
    as a ``RuntimeWarning`` (Python shows each message once per call site); the caller then
    runs the Triton kernel with the same config. The kernel plan (:mod:`distmoe.plan`) picks
    Gluon only where it runs, so this fires on explicit requests (a hand-written config or an
    override)."""
    warnings.warn(f"{kernel}: config.gluon is set, but the Gluon kernel cannot run this call "
                  f"({reason}); the Triton kernel runs the config instead", RuntimeWarning,
                  stacklevel=3)


def lockstep_counter(lockstep: bool, placeholder: torch.Tensor) -> torch.Tensor:
    """The ``sync_ptr`` argument of a Gluon kernel with lockstep producers: with ``lockstep``
    a zeroed int32 counter on ``placeholder``'s device, allocated per launch (the producers
    count their issued tiles in it), else ``placeholder``, which the kernel does not read."""
    if lockstep:
        return torch.zeros(1, dtype=torch.int32, device=placeholder.device)
    return placeholder
