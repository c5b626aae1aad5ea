"""Device-side barrier over a signal buffer of the symmetric heap (CUDA backends).

Signal buffer layout on every rank: int64 [world_size]; slot ``src`` holds the newest epoch
rank ``src`` has announced to this rank. A barrier is one single-program kernel:

1. bump this rank's local epoch counter (device memory, so CUDA-graph replays keep counting);
2. for every peer p: ``atomic_max(signal[p][rank], epoch)`` with release semantics at system
   scope (orders this rank's earlier writes before the signal);
3. spin with acquire loads until every slot of its own signal buffer reaches ``epoch``.

With a timeout (the context's ``timeout``, :attr:`SymmetricHeap.timeout`) the spin also reads
the GPU's global timer (``%globaltimer``, nanoseconds) and gives up once the barrier has waited
that long: the kernel then writes a failure record (the first rank that did not arrive, the
epoch, what its slot held, the nanoseconds waited) into a pinned host buffer that the host
reads without synchronising (:class:`~distmoe.runtime.cuda_common.CudaHeapBase`), and ends.
A barrier launched after a failure was recorded announces its epoch and does not wait. So a
dead or hung rank turns into an error on the host at this rank's next layer call instead of a
GPU spinning forever; the results of the call whose barrier timed out are not valid (a peer's
rows never arrived), and the context refuses every later call.

No host synchronisation; the kernel is stream-ordered, so everything launched before it on the
stream is complete and visible to peers once they pass it. Epochs are monotonic, so a fast rank
that already announced the next epoch still satisfies a slower rank's wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _globaltimer():
    """The GPU's global timer in nanoseconds (PTX ``%globaltimer``)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _device_barrier_kernel(signal_bases_ptr, epoch_ptr, rank, fail_addr, timeout_ns,
                           WORLD: tl.constexpr, TIMED: tl.constexpr):
    epoch = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, epoch)
    for p in tl.static_range(WORLD):
        peer_signal = tl.load(signal_bases_ptr + p).to(tl.pointer_type(tl.int64))
        tl.atomic_max(peer_signal + rank, epoch, sem="release", scope="sys")
    own_signal = tl.load(signal_bases_ptr + rank).to(tl.pointer_type(tl.int64))
    if TIMED:
        fail_ptr = fail_addr.to(tl.pointer_type(tl.int64))
        failed = tl.load(fail_ptr, volatile=True)
        start = _globaltimer()
        missing = tl.full((), -1, tl.int32)
        missing_seen = tl.full((), 0, tl.int64)
        for p in tl.static_range(WORLD):
            seen = tl.atomic_add(own_signal + p, 0, sem="acquire", scope="sys")
            waiting = (seen < epoch) & (failed == 0)
            while waiting:
                seen = tl.atomic_add(own_signal + p, 0, sem="acquire", scope="sys")
                waiting = (seen < epoch) & ((_globaltimer() - start) <= timeout_ns)
            first = (seen < epoch) & (missing < 0)
            missing = tl.where(first, p, missing)
            missing_seen = tl.where(first, seen, missing_seen)
        if (missing >= 0) & (failed == 0):
            tl.store(fail_ptr + 1, missing.to(tl.int64))
            tl.store(fail_ptr + 2, epoch)
            tl.store(fail_ptr + 3, missing_seen)
            tl.store(fail_ptr + 4, _globaltimer() - start)
            tl.store(fail_ptr, 1)  # the flag last: the host reads the record once it is set
    else:
        for p in tl.static_range(WORLD):
            seen = tl.atomic_add(own_signal + p, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(own_signal + p, 0, sem="acquire", scope="sys")


#: int64 fields of the failure record: flag (1 = failed), the first rank that did not arrive,
#: the barrier's epoch, what that rank's slot held, nanoseconds waited
FAIL_FIELDS = 5


def device_barrier(signal_bases: torch.Tensor, epoch: torch.Tensor, rank: int,
                   fail: torch.Tensor | None = None, timeout: float | None = None) -> None:
    """Launch the barrier kernel on the current stream (see the module docstring).

    Args:
        signal_bases: int64 [world_size] base addresses of every rank's signal buffer.
        epoch: int64 [1] this rank's epoch counter (device memory, starts at 0).
        rank: this rank.
        fail: with ``timeout``, the failure record: pinned host int64 [:data:`FAIL_FIELDS`],
            zero until a barrier times out (the kernel writes it through its address).
        timeout: seconds the barrier waits for every rank (None: no limit, no timer read).
    """
    timed = timeout is not None
    if timed and (fail is None or not fail.is_pinned() or fail.dtype != torch.int64
                  or fail.numel() < FAIL_FIELDS):
        raise ValueError(f"a timed barrier needs fail, a pinned int64 host tensor of "
                         f"{FAIL_FIELDS} elements")
    _device_barrier_kernel[(1,)](
        signal_bases, epoch, rank, fail.data_ptr() if timed else 0,
        int(timeout * 1e9) if timed else 0, WORLD=signal_bases.numel(), TIMED=timed,
        num_warps=1)
