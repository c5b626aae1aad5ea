"""Copy a contiguous bf16 range whose source or destination offset is known only on the device.

The activation buffer places saved state at a slot cursor that lives in device memory (the
save/replay decision and the cursor are computed on the device so that they work inside
CUDA-graph replay). Copies into and out of it take their element offset from an int64 ``[1]``
device tensor; a negative offset skips the copy (checked per program), which is how a
predicate decided on the device turns a copy off without a host round trip.

    dst[dst_offset + i] = src[src_offset + i]     for i < numel, if both offsets are >= 0

Grid: ``ceil(numel / BLOCK)`` programs from the static ``numel``; no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_tensor
from distmoe.kernels.base.device import device_context

_BLOCK = 4096


@triton.jit
def _offset_copy_kernel(src_ptr, src_off_ptr, dst_ptr, dst_off_ptr, numel,
                        HAS_SRC_OFF: tl.constexpr, HAS_DST_OFF: tl.constexpr,
                        BLOCK: tl.constexpr):
    src_off = tl.zeros([], dtype=tl.int64)
    dst_off = tl.zeros([], dtype=tl.int64)
    if HAS_SRC_OFF:
        src_off = tl.load(src_off_ptr)
    if HAS_DST_OFF:
        dst_off = tl.load(dst_off_ptr)
    if (src_off >= 0) & (dst_off >= 0):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < numel
        tl.store(dst_ptr + dst_off + i, tl.load(src_ptr + src_off + i, mask=mask), mask=mask)


def _check_offset(name: str, offset: object, device: torch.device) -> None:
    check_tensor(name, offset, dtypes=(torch.int64,), shape=[1], shape_text="[1]")
    if offset.device != device:
        raise ValueError(f"{name} must be on {device}, got {offset.device}")


def offset_copy(dst: torch.Tensor, src: torch.Tensor, numel: int, *,
                dst_offset: torch.Tensor | None = None,
                src_offset: torch.Tensor | None = None) -> None:
    """Copy ``numel`` bf16 elements from ``src`` (+ ``src_offset[0]``) to ``dst``
    (+ ``dst_offset[0]``); a negative device offset skips the copy.

    Args:
        dst, src: contiguous bf16 tensors on one device (viewed flat). With an offset, the
            tensor is a base (for example a whole activation buffer viewed as bf16) and the
            caller guarantees that ``offset + numel`` stays inside it.
        numel: elements to copy (a host int: it sizes the grid).
        dst_offset / src_offset: optional int64 ``[1]`` device tensors (bf16 elements).
    """
    for name, t in (("dst", dst), ("src", src)):
        check_tensor(name, t, dtypes=(torch.bfloat16,))
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if src.device != dst.device:
        raise ValueError(f"src ({src.device}) and dst ({dst.device}) must be on one device")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    for name, t, off in (("dst", dst, dst_offset), ("src", src, src_offset)):
        if off is None:
            if numel > t.numel():
                raise ValueError(f"numel ({numel}) exceeds {name}'s {t.numel()} elements")
        else:
            _check_offset(f"{name}_offset", off, dst.device)
    if numel == 0:
        return
    grid = (triton.cdiv(numel, _BLOCK),)
    with device_context(dst.device):
        _offset_copy_kernel[grid](
            src, src if src_offset is None else src_offset,
            dst, dst if dst_offset is None else dst_offset, numel,
            HAS_SRC_OFF=src_offset is not None, HAS_DST_OFF=dst_offset is not None,
            BLOCK=_BLOCK,
        )
