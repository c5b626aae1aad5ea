"""The layer's device-side call counters, updated by one program per call.

:class:`distmoe.ops.context.MoEContext` keeps int64 ``[5]`` counters for ``stats()``: the
last call's received rows, the most received rows of any call, the dropped rows and invalid
ids summed over calls, and the call count. Each forward updates them from its routing
tables' counters. Five torch ops did that before: five launches of about 1 us each on the
stream between the routing tables and W13, on the critical path of every forward
(docs/performance.md run 32). This is one launch, of one program that reads three scalars and
writes five. No host synchronisation; capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels._common import check_tensor, device_context
from distmoe.kernels.interpreter import interpreter_active


@triton.jit
def _count_call_kernel(counters_ptr, recv_ptr, dropped_ptr, invalid_ptr):
    recv = tl.load(recv_ptr).to(tl.int64)
    tl.store(counters_ptr + 0, recv)
    tl.store(counters_ptr + 1, tl.maximum(tl.load(counters_ptr + 1), recv))
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + tl.load(dropped_ptr).to(tl.int64))
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + tl.load(invalid_ptr).to(tl.int64))
    tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + 1)


def count_call(counters: torch.Tensor, num_recv_rows: torch.Tensor,
               num_dropped_rows: torch.Tensor, num_invalid_ids: torch.Tensor) -> None:
    """``counters`` (int64 ``[5]``) ``<- [recv, max(counters[1], recv), counters[2] +
    dropped, counters[3] + invalid, counters[4] + 1]`` from three integer scalar tensors
    (one element each) on the same device. One Triton program on a CUDA device or under the
    interpreter; torch ops elsewhere."""
    check_tensor("counters", counters, dtypes=(torch.int64,), shape=[5],
                 shape_text="[last, max, dropped, invalid, calls]")
    ints = (torch.int32, torch.int64)
    for name, t in (("num_recv_rows", num_recv_rows), ("num_dropped_rows", num_dropped_rows),
                    ("num_invalid_ids", num_invalid_ids)):
        check_tensor(name, t, dtypes=ints)
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {list(t.shape)}")
        if t.device != counters.device:
            raise ValueError(f"{name} must be on {counters.device}, got {t.device}")
    if counters.device.type != "cuda" and not interpreter_active():
        counters[0].copy_(num_recv_rows.reshape(()))
        torch.maximum(counters[1], counters[0], out=counters[1])
        counters[2].add_(num_dropped_rows.reshape(()))
        counters[3].add_(num_invalid_ids.reshape(()))
        counters[4].add_(1)
        return
    with device_context(counters.device):
        _count_call_kernel[(1,)](counters, num_recv_rows, num_dropped_rows, num_invalid_ids,
                                 num_warps=1)


__all__ = ["count_call"]
