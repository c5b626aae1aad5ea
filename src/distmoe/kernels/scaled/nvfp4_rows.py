"""NVFP4 token rows packed on their owner and read by the experts: the nvfp4 layer's source-rank
quantisation at EP > 1 (issue 59, item 3).

The owner quantises each of its T token rows along D (:func:`distmoe.quant.nvfp4_quantize`
with one global scale per row) and packs the result into the first bytes of the row's own
slot in its dispatch buffer (a slot holds ``2 D`` bytes, room for a bf16 row), so the row
tables, base addresses and row strides of the bf16 layer stay as they are. Slot layout
(:func:`nvfp4_row_layout`), in bytes from the slot's start::

    [0, D/2)                 E2M1 codes, two per byte (even element in the low nibble)
    [D/2, D/2 + D/16)        E4M3 block scales, one per 16 values
    [G, G + 4)               float32 global scale s_g, G = D/2 + D/16 rounded up to 16

Peers then move ``G + 4`` bytes per row instead of ``2 D`` (about 0.57 D: 3.6x fewer).

The experts' side, :func:`gather_nvfp4_rows`: for every expert ``e`` and live row ``j``, with
``a = row_offsets[e] + j`` and ``r = padded_offsets[e] + j``::

    out[a]       = bf16(v * s_b) of the packed row at gather_ptrs[r]   (exact: a 2-bit
                                                                       significand times an
                                                                       E4M3 scale)
    row_scale[a] = its s_g                                             (zeros / 0 where the
                                                                       address is 0)

The W13 GEMM multiplies its fp32 accumulator by ``row_scale`` with the weights' global scale
(:func:`~distmoe.kernels.scaled.nvfp4.nvfp4_weight_grouped_mm`'s ``a_row_scale``), so the
layer computes exactly on the decoded values of both operands. Padding rows are not read and
no other row is written. Grid: ``R_cap / BLOCK_M`` row tiles (``BLOCK_M`` divides the padding
multiple) times the column tiles, from the static bounds. No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import (
    check_block_m,
    check_devices,
    check_expert_tables,
    check_gather_r_cap,
    check_tensor,
)
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context
from distmoe.kernels.base.tiles import tile_row_addresses
from distmoe.kernels.scaled.nvfp4 import e2m1_pairs_to_bf16, nvfp4_weight_values
from distmoe.quant.formats import NVFP4_BLOCK, e4m3_byte_to_fp32
from distmoe.quant.nvfp4 import nvfp4_quantize

__all__ = ["gather_nvfp4_rows", "gather_nvfp4_rows_ref", "nvfp4_row_layout", "pack_nvfp4_rows",
           "unpack_nvfp4_rows"]

_BLOCK_ROWS = 16
_BLOCK_BYTES = 128  # packed bytes per program along a row: 256 values


def nvfp4_row_layout(hidden: int) -> tuple[int, int, int]:
    """``(scales_at, global_at, num_bytes)`` of a packed row of ``hidden`` values (module
    docstring): where its block scales and its global scale start, and the bytes it takes
    (``hidden`` a multiple of 16; the packed row fits in the ``2 * hidden`` bytes of a bf16
    slot for every such ``hidden``)."""
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < NVFP4_BLOCK \
            or hidden % NVFP4_BLOCK:
        raise ValueError(f"hidden ({hidden!r}) must be a positive multiple of {NVFP4_BLOCK} "
                         "(one E4M3 block scale per 16 values)")
    scales_at = hidden // 2
    global_at = -(-(scales_at + hidden // NVFP4_BLOCK) // 16) * 16
    return scales_at, global_at, global_at + 4


def _slot_views(slots: torch.Tensor, hidden: int):
    scales_at, global_at, _ = nvfp4_row_layout(hidden)
    return (slots[:, :scales_at], slots[:, scales_at:scales_at + hidden // NVFP4_BLOCK],
            slots[:, global_at:global_at + 4].view(torch.float32)[:, 0])


def _check_slots(slots: object, rows: int, hidden: int) -> None:
    check_tensor("slots", slots, dtypes=(torch.uint8,), ndim=2,
                 shape_text="[rows, 2 * hidden] (the bf16 dispatch slots, as bytes)",
                 contiguous=False)
    if slots.shape[0] < rows or slots.shape[1] != 2 * hidden or slots.stride(1) != 1:
        raise ValueError(f"slots must be [>= {rows}, {2 * hidden}] uint8 with unit stride along "
                         f"a slot (the dispatch rows as bytes), got shape {list(slots.shape)} "
                         f"and strides {slots.stride()}")


def pack_nvfp4_rows(x: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise ``x [T, D]`` (bf16, D a multiple of 16) row by row and pack each row into
    ``slots[t]`` (uint8 ``[>= T, 2 D]``, a slot per row, the layout of the module docstring);
    bytes past a packed row are left as they are. x may overlap the slots (it is quantised
    into temporaries first: stream order makes the packing read them after)."""
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2, shape_text="[T, D]")
    rows, hidden = x.shape
    _check_slots(slots, rows, hidden)
    nvfp4_row_layout(hidden)
    check_devices({"x": x, "slots": slots})
    if rows == 0:
        return
    packed, scales, gs = nvfp4_quantize(x, per="row")
    codes, block_scales, global_scales = _slot_views(slots[:rows], hidden)
    codes.copy_(packed)
    block_scales.copy_(scales.view(torch.uint8))
    global_scales.copy_(gs[:, 0])


def unpack_nvfp4_rows(slots: torch.Tensor, hidden: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed [T, D/2] uint8, block_scales [T, D/16] float8_e4m3fn, global_scale [T, 1]
    float32)`` of packed slots (copies; plain PyTorch): :func:`distmoe.quant.nvfp4_dequantize`
    of them gives the values the layer computes with."""
    codes, block_scales, global_scales = _slot_views(slots, hidden)
    return (codes.contiguous(), block_scales.contiguous().view(torch.float8_e4m3fn),
            global_scales.contiguous()[:, None])


@triton.jit
def _gather_nvfp4_kernel(gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, out_ptr,
                         scale_ptr, HIDDEN: tl.constexpr, BLOCK_B: tl.constexpr,
                         GLOBAL_AT: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """One tile: ``BLOCK_M`` padded rows by ``BLOCK_B`` packed bytes (``2 BLOCK_B`` values);
    the column tile 0 also copies the rows' global scales."""
    act_start, num_live, idx, is_live, src = tile_row_addresses(
        gather_ptrs_ptr, padded_offsets_ptr, row_offsets_ptr, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M)
    if num_live > 0:  # live rows come first in a segment
        rows = src.to(tl.pointer_type(tl.uint8))
        # byte j holds values 2 j (low nibble) and 2 j + 1
        j = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        ok = (src != 0)[:, None] & (j < HIDDEN // 2)[None, :]
        byte = tl.load(rows[:, None] + j[None, :], mask=ok, other=0).to(tl.int32)
        # a block scale per 8 bytes (16 values)
        sb = tl.load(rows[:, None] + (HIDDEN // 2 + j // 8)[None, :], mask=ok,
                     other=0).to(tl.int32)
        even, odd = e2m1_pairs_to_bf16(byte, e4m3_byte_to_fp32(sb))
        vals = tl.reshape(tl.join(even, odd), (BLOCK_M, 2 * BLOCK_B))  # interleave
        dst = out_ptr + (act_start + idx).to(tl.int64) * HIDDEN
        cols = 2 * tl.program_id(1) * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
        tl.store(dst[:, None] + cols[None, :], vals,
                 mask=is_live[:, None] & (cols < HIDDEN)[None, :])
        if tl.program_id(1) == 0:
            g = tl.load((rows + GLOBAL_AT).to(tl.pointer_type(tl.float32)), mask=src != 0,
                        other=0.0)
            tl.store(scale_ptr + act_start + idx, g, mask=is_live)


def _check_gather(gather_ptrs, padded_offsets, row_offsets, out, row_scale, block_m):
    check_tensor("gather_ptrs", gather_ptrs, dtypes=(torch.int64,), ndim=1,
                 shape_text="[R_cap] (packed row addresses by padded row)")
    check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R_act, D]")
    check_tensor("row_scale", row_scale, dtypes=(torch.float32,), shape=[out.shape[0]],
                 shape_text="[R_act] (each row's global scale)")
    nvfp4_row_layout(out.shape[1])
    num_experts = check_expert_tables(padded_offsets, row_offsets)
    check_block_m(block_m)
    check_gather_r_cap(gather_ptrs.shape[0], block_m)
    check_devices(dict(gather_ptrs=gather_ptrs, padded_offsets=padded_offsets,
                       row_offsets=row_offsets, out=out, row_scale=row_scale))
    return num_experts


def gather_nvfp4_rows(gather_ptrs: torch.Tensor, padded_offsets: torch.Tensor,
                      row_offsets: torch.Tensor, out: torch.Tensor, row_scale: torch.Tensor, *,
                      block_m: int) -> torch.Tensor:
    """Read packed rows into activation order, decoded (module docstring).

    Args:
        gather_ptrs: int64 ``[R_cap]`` indexed by padded row: absolute byte address of each
            row's packed slot (:func:`pack_nvfp4_rows`), 0 = null row (zeros, scale 0).
        padded_offsets / row_offsets: int32 ``[E_local + 1]`` (device): the padded segments
            (multiples of ``block_m``) and the live rows' exclusive prefix sum.
        out: bf16 ``[R_act, D]`` contiguous, ``R_act >= row_offsets[E_local]``: ``v * s_b``.
        row_scale: float32 ``[R_act]``: each row's global scale ``s_g``.
        block_m: the padding multiple, a power of two >= 16 dividing ``R_cap``.

    Returns ``out``.
    """
    num_experts = _check_gather(gather_ptrs, padded_offsets, row_offsets, out, row_scale,
                                block_m)
    r_cap, hidden = gather_ptrs.shape[0], out.shape[1]
    if r_cap == 0 or out.shape[0] == 0:
        return out
    block_rows = min(_BLOCK_ROWS, block_m)
    block_b = min(_BLOCK_BYTES, next_power_of_2(hidden // 2))
    _, global_at, _ = nvfp4_row_layout(hidden)
    grid = (r_cap // block_rows, triton.cdiv(hidden // 2, block_b))
    with device_context(out.device):
        _gather_nvfp4_kernel[grid](
            gather_ptrs, padded_offsets, row_offsets, out, row_scale, HIDDEN=hidden,
            BLOCK_B=block_b, GLOBAL_AT=global_at, NUM_EXPERTS=num_experts,
            EXPERTS_POW2=max(2, next_power_of_2(num_experts)), BLOCK_M=block_rows,
            num_warps=4,
        )  # fmt: skip
    return out


def gather_nvfp4_rows_ref(slots_of, gather_ptrs: torch.Tensor, padded_offsets: torch.Tensor,
                          row_offsets: torch.Tensor, out: torch.Tensor,
                          row_scale: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch :func:`gather_nvfp4_rows` (synchronises; for tests). ``slots_of(address)``
    returns the uint8 ``[2 D]`` slot at a row address (the caller knows its buffers)."""
    hidden = out.shape[1]
    po, ro = padded_offsets.tolist(), row_offsets.tolist()
    for e in range(len(po) - 1):
        for j in range(ro[e + 1] - ro[e]):
            address = int(gather_ptrs[po[e] + j])
            a = ro[e] + j
            if address == 0:
                out[a] = 0
                row_scale[a] = 0
                continue
            packed, scales, gs = unpack_nvfp4_rows(slots_of(address)[None], hidden)
            out[a] = nvfp4_weight_values(packed[0], scales[0]).to(torch.bfloat16)
            row_scale[a] = gs[0, 0]
    return out
