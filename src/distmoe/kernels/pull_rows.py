"""Pull the peer rows a pointer table names into local memory, once per row (EP > 1).

The expert GEMMs read their A rows through a table of absolute row addresses (``gather_ptrs``
in forward, ``scatter_ptrs`` for the route output gradients in backward). Every column tile
of a row tile reads those rows again: on the rank's own memory the re-reads hit L2, but a
peer's rows cross NVLink on every read, because a GPU does not keep peer memory in its L2.
At T=8192, D=4096, F=2048, E=32, K=8 on two H200s the W13 forward has 16 column tiles, so it
read each remote row 16 times, about 4.3 GB per rank at 395 GB/s, and the EP=2 forward took
2.7x the EP=1 time of the same per-rank work (docs/performance.md, run 8).

This kernel copies each remote row once into a local buffer and writes a table whose remote
entries point at the copies, local and null entries unchanged:

    remote(p)   = src_ptrs[p] != 0 and not (local_lo <= src_ptrs[p] < local_hi)
    out_ptrs[p] = dst_base + p * ROW_BYTES   if remote(p) else src_ptrs[p]
    dst[p, :]   = the ROW_ELEMS bf16 values at src_ptrs[p]   if remote(p)   (else untouched)

for every padded row p < R_cap; ``[local_lo, local_hi)`` is the byte range of the rank's own
buffer that the table points into. The GEMM then reads the new table exactly as it read the
old one. Grid: ``ceil(R_cap / BLOCK_R)`` programs from the static capacity; programs past the
used rows (``padded_offsets[E_local]``, read on the device) only copy the table. No host
synchronisation, so it runs inside CUDA-graph capture.

Reads happen where the GEMM's reads used to (after the same barrier, before the next), so the
safety argument of :mod:`distmoe.ops.context` and :mod:`distmoe.ops.autograd` is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels._common import check_tensor, device_context, next_power_of_2

_BLOCK_R = 16
_BLOCK_D = 512


@triton.jit
def _pull_rows_kernel(src_ptrs_ptr, dst_base, out_ptrs_ptr, used_rows_ptr, enable_ptr,
                      local_lo, local_hi, r_cap, ROW_ELEMS: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr, HAS_ENABLE: tl.constexpr):
    if HAS_ENABLE:
        if tl.load(enable_ptr) == 0:
            return
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_cap = rows < r_cap
    src = tl.load(src_ptrs_ptr + rows, mask=in_cap, other=0)
    remote = in_cap & (src != 0) & ((src < local_lo) | (src >= local_hi))
    dst = dst_base + rows * (ROW_ELEMS * 2)
    tl.store(out_ptrs_ptr + rows, tl.where(remote, dst, src), mask=in_cap)
    used = tl.load(used_rows_ptr).to(tl.int64)
    if tl.program_id(0).to(tl.int64) * BLOCK_R < used:
        # Row addresses are multiples of 16 bytes (the tables' requirement); the hint on the
        # pointer tensors keeps the copies 16-byte vectors.
        src_rows = tl.multiple_of(src.to(tl.pointer_type(tl.bfloat16)), 16)
        dst_rows = tl.multiple_of(dst.to(tl.pointer_type(tl.bfloat16)), 16)
        for d in range(0, ROW_ELEMS, BLOCK_D):
            cols = d + tl.arange(0, BLOCK_D)
            mask = remote[:, None] & (cols < ROW_ELEMS)[None, :]
            vals = tl.load(src_rows[:, None] + cols[None, :], mask=mask)
            tl.store(dst_rows[:, None] + cols[None, :], vals, mask=mask)


def pull_rows(src_ptrs: torch.Tensor, used_rows: torch.Tensor, dst: torch.Tensor,
              out_ptrs: torch.Tensor, local: torch.Tensor, *,
              enable: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the rows of ``src_ptrs`` outside ``local`` into ``dst``; returns ``out_ptrs``.

    Args:
        src_ptrs: int64 ``[R_cap]`` absolute byte addresses of bf16 rows (0 = null), each a
            multiple of 16; rows of peers' buffers and of ``local``.
        used_rows: int32/int64 tensor whose first element is the number of used padded rows
            (``padded_offsets[E_local:]``); rows past it are only copied in the table.
        dst: bf16 ``[R_cap, D]`` contiguous local buffer; row p receives remote row p.
        out_ptrs: int64 ``[R_cap]`` (written): the table the GEMM reads instead.
        local: the rank's own buffer that ``src_ptrs`` points into (rows left in place).
        enable: optional int32 ``[1]`` on the device: 0 = nothing is read or written (the
            consumer is off too, as for a saved layer's replay steps).
    Returns:
        ``out_ptrs``.
    """
    check_tensor("src_ptrs", src_ptrs, dtypes=(torch.int64,), ndim=1, shape_text="[R_cap]")
    r_cap = src_ptrs.shape[0]
    check_tensor("dst", dst, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_cap, D]")
    check_tensor("out_ptrs", out_ptrs, dtypes=(torch.int64,), shape=[r_cap],
                 shape_text="[R_cap]")
    check_tensor("used_rows", used_rows, dtypes=(torch.int32, torch.int64))
    if dst.shape[0] != r_cap or not dst.is_contiguous():
        raise ValueError(f"dst must be contiguous with R_cap ({r_cap}) rows, got shape "
                         f"{tuple(dst.shape)}")
    row_elems = dst.shape[1]
    if (row_elems * 2) % 16 or dst.data_ptr() % 16:
        raise ValueError(f"dst rows must be 16-byte aligned, got D={row_elems} at "
                         f"address {dst.data_ptr():#x}")
    if enable is not None:
        check_tensor("enable", enable, dtypes=(torch.int32,), shape=[1], shape_text="(0 = skip)")
    for name, t in (("src_ptrs", src_ptrs), ("used_rows", used_rows), ("out_ptrs", out_ptrs),
                    ("local", local), ("enable", src_ptrs if enable is None else enable)):
        if t.device != dst.device:
            raise ValueError(f"{name} must be on {dst.device}, got {t.device}")
    if r_cap == 0:
        return out_ptrs
    lo = local.data_ptr()
    hi = lo + local.numel() * local.element_size()
    with device_context(dst.device):
        _pull_rows_kernel[(triton.cdiv(r_cap, _BLOCK_R),)](
            src_ptrs, dst.data_ptr(), out_ptrs, used_rows,
            used_rows if enable is None else enable,  # placeholder: never read
            lo, hi, r_cap, ROW_ELEMS=row_elems, BLOCK_R=_BLOCK_R,
            BLOCK_D=min(_BLOCK_D, next_power_of_2(row_elems)), HAS_ENABLE=enable is not None,
        )
    return out_ptrs
