"""The layer's device-side call counters, updated by one program per call.

:class:`distmoe.ops.context.MoEContext` keeps int64 ``[6]`` counters for ``stats()``: the
last call's received rows, the most received rows of any call, the dropped rows and invalid
ids summed over calls, the call count, and the calls in which some rank published a token
count other than this rank's (the layer needs the same T on every rank; unchecked, a
mismatch is not refused, but it is counted here). Each forward updates them from its routing
tables' counters and every rank's published header, in one launch of one program: it sits
on the critical path between the routing tables and W13, where five small torch kernels
would each cost a launch. No host synchronisation; capturable in a CUDA graph.

The headers are read after the publish barrier and before the call's last barrier, so every
rank's header holds this call's T (the next call writes its own after that barrier).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.kernels.base.interpreter import interpreter_active

#: entries of the counters tensor
NUM_COUNTERS = 6


@triton.jit
def _count_call_kernel(counters_ptr, recv_ptr, dropped_ptr, invalid_ptr, header_bases_ptr,
                       tokens, EP: tl.constexpr):
    recv = tl.load(recv_ptr).to(tl.int64)
    tl.store(counters_ptr + 0, recv)
    tl.store(counters_ptr + 1, tl.maximum(tl.load(counters_ptr + 1), recv))
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + tl.load(dropped_ptr).to(tl.int64))
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + tl.load(invalid_ptr).to(tl.int64))
    tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + 1)
    mismatch = 0
    for r in tl.static_range(EP):
        header = tl.load(header_bases_ptr + r).to(tl.pointer_type(tl.int32))
        mismatch = tl.maximum(mismatch, (tl.load(header, volatile=True) != tokens).to(tl.int32))
    tl.store(counters_ptr + 5, tl.load(counters_ptr + 5) + mismatch.to(tl.int64))


def count_call(counters: torch.Tensor, num_recv_rows: torch.Tensor,
               num_dropped_rows: torch.Tensor, num_invalid_ids: torch.Tensor, *,
               header_bases: torch.Tensor, headers: list[torch.Tensor], tokens: int) -> None:
    """Update ``counters`` (int64 ``[6]``) for one call: ``[recv, max(counters[1], recv),
    counters[2] + dropped, counters[3] + invalid, counters[4] + 1, counters[5] + (1 if some
    rank's header T != tokens else 0)]``.

    Args:
        counters: int64 ``[6]`` on the device (updated in place).
        num_recv_rows, num_dropped_rows, num_invalid_ids: integer scalar tensors (one
            element each) of the routing tables, on the same device.
        header_bases: int64 ``[EP]`` (device): every rank's routing header address, whose
            first int32 is that rank's published token count.
        headers: the same headers as int32 tensors (views), one per rank, for the torch ops
            that run where neither CUDA nor the interpreter does.
        tokens: this rank's T.

    One Triton program on a CUDA device or under the interpreter; torch ops elsewhere."""
    check_tensor("counters", counters, dtypes=(torch.int64,), shape=[NUM_COUNTERS],
                 shape_text="[last, max, dropped, invalid, calls, token count mismatches]")
    ints = (torch.int32, torch.int64)
    for name, t in (("num_recv_rows", num_recv_rows), ("num_dropped_rows", num_dropped_rows),
                    ("num_invalid_ids", num_invalid_ids)):
        check_tensor(name, t, dtypes=ints)
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {list(t.shape)}")
        if t.device != counters.device:
            raise ValueError(f"{name} must be on {counters.device}, got {t.device}")
    check_tensor("header_bases", header_bases, dtypes=(torch.int64,), ndim=1, shape_text="[EP]")
    if len(headers) != header_bases.shape[0]:
        raise ValueError(f"headers must list one tensor per rank ({header_bases.shape[0]}), "
                         f"got {len(headers)}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens ({tokens!r}) must be an int >= 0")
    if counters.device.type != "cuda" and not interpreter_active():
        counters[0].copy_(num_recv_rows.reshape(()))
        torch.maximum(counters[1], counters[0], out=counters[1])
        counters[2].add_(num_dropped_rows.reshape(()))
        counters[3].add_(num_invalid_ids.reshape(()))
        counters[4].add_(1)
        published = torch.stack([h.reshape(-1)[0] for h in headers])
        counters[5].add_((published != tokens).any().to(torch.int64))
        return
    with device_context(counters.device):
        _count_call_kernel[(1,)](counters, num_recv_rows, num_dropped_rows, num_invalid_ids,
                                 header_bases, tokens, EP=header_bases.shape[0], num_warps=1)


__all__ = ["NUM_COUNTERS", "count_call"]
