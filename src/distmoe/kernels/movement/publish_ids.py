"""Publish a forward's token count and expert ids into this rank's routing buffer, one launch.

    header[0]        = T                                      (int32)
    out[i]           = ids[i]  if -1 <= ids[i] < E  else -2   (int16, i < T * K)

The routing buffer holds ids as int16 (E <= 32767). A plain ``copy_`` of int32 / int64 ids
would wrap an id beyond int16 into a valid one (65537 -> 1); here every id outside
[-1, E) becomes -2, which the routing tables count as invalid and never execute, like any
other invalid id. Any integer dtype of ids is read (int8, uint8, int16, int32, int64); an
unsigned id is never negative. Grid: ``max(1, ceil(T * K / BLOCK))`` programs from host
sizes; no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.device import device_context

_BLOCK = 1024


# tokens is never specialised: Triton turns an int argument equal to 1 into a constant, which
# has no .to() (a call with T = 1 failed to compile on the GPU; the interpreter never
# specialises)
@triton.jit(do_not_specialize=["tokens"])
def _publish_ids_kernel(ids_ptr, out_ptr, header_ptr, numel, tokens, num_experts,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(header_ptr, tokens.to(tl.int32))
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    v = tl.load(ids_ptr + i, mask=mask, other=0).to(tl.int64)
    v = tl.where((v < -1) | (v >= num_experts), -2, v)
    tl.store(out_ptr + i, v.to(tl.int16), mask=mask)


def publish_ids(ids: torch.Tensor, out: torch.Tensor, header: torch.Tensor, *,
                num_experts: int) -> None:
    """Write ``ids.shape[0]`` into ``header[0]`` and ``ids`` (clamped to invalid -2 outside
    [-1, num_experts)) into the first ``ids.numel()`` elements of ``out``.

    Args:
        ids: contiguous ``[T, K]`` integer tensor (the caller validated dtype and shape).
        out: contiguous int16 tensor with at least ``ids.numel()`` elements, on ids' device.
        header: int32 tensor (its element 0 receives T), on ids' device.
        num_experts: E, in [1, 32767].
    """
    if out.dtype != torch.int16 or header.dtype != torch.int32:
        raise TypeError(f"out must be int16 and header int32, got {out.dtype} and "
                        f"{header.dtype}")
    if out.numel() < ids.numel():
        raise ValueError(f"out ({out.numel()} elements) must hold ids ({ids.numel()})")
    if not 1 <= num_experts <= 32767:
        raise ValueError(f"num_experts ({num_experts}) must be in [1, 32767] (int16 ids)")
    numel = ids.numel()
    grid = (max(1, triton.cdiv(numel, _BLOCK)),)
    with device_context(ids.device):
        _publish_ids_kernel[grid](ids, out, header, numel, ids.shape[0], num_experts,
                                  BLOCK=_BLOCK)
