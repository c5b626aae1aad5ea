"""Device-side barrier over a signal buffer of the symmetric heap (CUDA backends).

Signal buffer layout on every rank: int64 [world_size]; slot ``src`` holds the newest epoch
rank ``src`` has announced to this rank. A barrier is one single-program kernel:

1. bump this rank's local epoch counter (device memory, so CUDA-graph replays keep counting);
2. for every peer p: ``atomic_max(signal[p][rank], epoch)`` with release semantics at system
   scope (orders this rank's earlier writes before the signal);
3. spin with acquire loads until every slot of its own signal buffer reaches ``epoch``.

No host synchronisation; the kernel is stream-ordered, so everything launched before it on the
stream is complete and visible to peers once they pass it. Epochs are monotonic, so a fast rank
that already announced the next epoch still satisfies a slower rank's wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _device_barrier_kernel(signal_bases_ptr, epoch_ptr, rank, WORLD: tl.constexpr):
    epoch = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, epoch)
    for p in tl.static_range(WORLD):
        peer_signal = tl.load(signal_bases_ptr + p).to(tl.pointer_type(tl.int64))
        tl.atomic_max(peer_signal + rank, epoch, sem="release", scope="sys")
    own_signal = tl.load(signal_bases_ptr + rank).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(WORLD):
        seen = tl.atomic_add(own_signal + p, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(own_signal + p, 0, sem="acquire", scope="sys")


def device_barrier(signal_bases: torch.Tensor, epoch: torch.Tensor, rank: int) -> None:
    """Launch the barrier kernel on the current stream (see the module docstring).

    Args:
        signal_bases: int64 [world_size] base addresses of every rank's signal buffer.
        epoch: int64 [1] this rank's epoch counter (device memory, starts at 0).
        rank: this rank.
    """
    _device_barrier_kernel[(1,)](signal_bases, epoch, rank, WORLD=signal_bases.numel(),
                                 num_warps=1)
