"""SwiGLU forward and backward on activation rows, fused with the FP8 quantisation of their
result (Triton), for the FP8 training layer (:mod:`distmoe.ops.lowp_train`).

``B`` = 32 (``"mxfp8"``: E8M0 scales), 128 (``"mxfp8_rebased"``: four 32-blocks rebased onto
one E8M0 scale, :func:`distmoe.quant.mxfp8_rebase`; ``"fp8_block"``: float32 scales);
``h1 [R, 2F]`` bf16 holds
gate columns ``[0, F)`` then up columns ``[F, 2F)``; all math in fp32::

    forward   h2 = bf16(silu(g) * u)                                          [R, F]
              (h2_q, h2_s) = the quantiser of ``precision`` applied to h2 along F
    backward  s = sigmoid(g);  dg = d * u * s * (1 + g * (1 - s));  du = d * g * s
              gh1 = bf16([dg, du])                                            [R, 2F]
              (gh1_q, gh1_s) = the quantiser applied to gh1 along 2F
              h2 = bf16(g * s * u) (the W2 WGRAD operand; optional)

The quantisation is the quantisers' own arithmetic (:func:`distmoe.quant.mxfp8.mxfp8_encode`,
:func:`distmoe.quant.fp8_block.fp8_block_encode`) applied to the bf16 values stored, so
``(q, s)`` are bit for bit ``mxfp8_quantize_2d`` / ``mxfp8_quantize_rebased_2d`` /
``fp8_block_quantize_2d`` of the stored bf16 tensor (tested). Why fused: unfused, each is a chain of fp32 elementwise passes over
``R x 2F`` plus a quantiser pass; fused, ``h1`` (and ``gh2``) are read once and the results
written once.

One program per ``BLOCK_R`` rows x one ``B``-wide column group (of F): grid from R and F,
no host synchronisation; every row of ``[0, R)`` is computed (the caller's rows past the
live ones hold whatever the GEMMs left there; their results are never read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context
from distmoe.quant.formats import float32_bits
from distmoe.quant.fp8_block import fp8_block_encode
from distmoe.quant.mxfp8 import mxfp8_encode, mxfp8_rebase_codes

#: values per scale and the scale dtype per format ("mxfp8_rebased": four 32-blocks rebased
#: onto one E8M0 scale per 128, distmoe.quant.mxfp8_rebase)
_FORMATS = {"mxfp8": (32, torch.uint8), "mxfp8_rebased": (128, torch.uint8),
            "fp8_block": (128, torch.float32)}


@triton.jit
def _encode(v, FP32_SCALES: tl.constexpr, REBASE: tl.constexpr, ROWS: tl.constexpr,
            B: tl.constexpr):
    """``(E4M3 bytes [ROWS, B], scales [ROWS, 1])`` of fp32 values ``v [ROWS, B]``: one
    block-FP8 scale per 128, one E8M0 scale per 32, or (``REBASE``) four 32-blocks rebased
    onto one E8M0 scale per 128."""
    if FP32_SCALES:
        q, s = fp8_block_encode(float32_bits(tl.reshape(v, (ROWS, 1, B))))
    elif REBASE:
        bits = float32_bits(tl.reshape(v, (ROWS, B // 32, 32)))
        q, e = mxfp8_encode(bits)
        q, e = mxfp8_rebase_codes(bits, q, e, ROWS, B // 32)
        s = (tl.max(e, axis=1) + 127).to(tl.uint8)[:, None]
    else:
        q, e = mxfp8_encode(float32_bits(tl.reshape(v, (ROWS, 1, B))))
        s = (e + 127).to(tl.uint8)
    return tl.reshape(q, (ROWS, B)), s


@triton.jit
def _swiglu_quant_kernel(h1_ptr, gh2_ptr, out_ptr, q_ptr, s_ptr, h2_ptr, rows,
                         F: tl.constexpr, B: tl.constexpr, FP32_SCALES: tl.constexpr,
                         REBASE: tl.constexpr, BACKWARD: tl.constexpr,
                         STORE_H2: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_r = tl.program_id(0)
    grp = tl.program_id(1)
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = grp * B + tl.arange(0, B)
    ok = (r < rows)[:, None]
    row1 = r[:, None] * (2 * F)
    g = tl.load(h1_ptr + row1 + c[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h1_ptr + row1 + F + c[None, :], mask=ok, other=0.0).to(tl.float32)
    sg = tl.sigmoid(g)
    ngroups: tl.constexpr = F // B
    if BACKWARD:
        d = tl.load(gh2_ptr + r[:, None] * F + c[None, :], mask=ok, other=0.0).to(tl.float32)
        dg = (d * u * sg * (1.0 + g * (1.0 - sg))).to(tl.bfloat16)
        du = (d * g * sg).to(tl.bfloat16)
        tl.store(out_ptr + row1 + c[None, :], dg, mask=ok)
        tl.store(out_ptr + row1 + F + c[None, :], du, mask=ok)
        qg, s_g = _encode(dg.to(tl.float32), FP32_SCALES, REBASE, BLOCK_R, B)
        qu, s_u = _encode(du.to(tl.float32), FP32_SCALES, REBASE, BLOCK_R, B)
        q_offs = row1 + c[None, :]
        tl.store(q_ptr + q_offs, qg, mask=ok)
        tl.store(q_ptr + q_offs + F, qu, mask=ok)
        s_row = r[:, None] * (2 * ngroups)
        tl.store(s_ptr + s_row + grp, s_g, mask=ok)
        tl.store(s_ptr + s_row + ngroups + grp, s_u, mask=ok)
        if STORE_H2:
            tl.store(h2_ptr + r[:, None] * F + c[None, :], (g * sg * u).to(tl.bfloat16),
                     mask=ok)
    else:
        h2 = (g * sg * u).to(tl.bfloat16)
        offs = r[:, None] * F + c[None, :]
        tl.store(out_ptr + offs, h2, mask=ok)
        q, s = _encode(h2.to(tl.float32), FP32_SCALES, REBASE, BLOCK_R, B)
        tl.store(q_ptr + offs, q, mask=ok)
        tl.store(s_ptr + r[:, None] * ngroups + grp, s, mask=ok)


def _check(precision: str, h1: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
           width: int) -> tuple[int, int, torch.dtype]:
    if precision not in _FORMATS:
        raise ValueError(f"precision ({precision!r}) must be one of {tuple(_FORMATS)}")
    block, sdtype = _FORMATS[precision]
    check_tensor("h1", h1, dtypes=(torch.bfloat16,), ndim=2, shape_text="[R, 2F]")
    rows, two_f = h1.shape
    F = two_f // 2
    if two_f % 2 or F % block or F == 0:
        raise ValueError(f"h1 must be [R, 2F] with F a positive multiple of {block} for "
                         f"precision {precision!r}, got shape {list(h1.shape)}")
    check_tensor("q", q, dtypes=(torch.float8_e4m3fn,), shape=[rows, width * F],
                 shape_text="the quantised result's shape")
    check_tensor("s", s, dtypes=(sdtype,), shape=[rows, width * F // block],
                 shape_text=f"[R, width / {block}]")
    return rows, F, sdtype


def _launch(h1, gh2, out, q, s, h2, rows, F, precision, backward):
    if rows == 0:
        return
    block = _FORMATS[precision][0]
    block_r = 32 if block == 32 else 8
    grid = (triton.cdiv(rows, block_r), F // block)
    with device_context(h1.device):
        _swiglu_quant_kernel[grid](
            h1, gh2 if gh2 is not None else h1, out, q.view(torch.uint8), s,
            h2 if h2 is not None else out, rows, F=F, B=block,
            FP32_SCALES=precision == "fp8_block", REBASE=precision == "mxfp8_rebased",
            BACKWARD=backward, STORE_H2=h2 is not None,
            BLOCK_R=block_r, num_warps=4)


def swiglu_quantize(h1: torch.Tensor, h2: torch.Tensor, h2_q: torch.Tensor,
                    h2_s: torch.Tensor, *, precision: str) -> None:
    """Forward (module docstring): ``h2 [R, F]`` bf16, ``h2_q [R, F]`` float8_e4m3fn and
    ``h2_s [R, F/B]`` (uint8 E8M0 for mxfp8, float32 for fp8_block) written from ``h1
    [R, 2F]`` bf16. All contiguous on one device; nothing allocated."""
    rows, F, _ = _check(precision, h1, h2_q, h2_s, 1)
    check_tensor("h2", h2, dtypes=(torch.bfloat16,), shape=[rows, F], shape_text="[R, F]")
    check_devices({"h1": h1, "h2": h2, "h2_q": h2_q, "h2_s": h2_s})
    _launch(h1, None, h2, h2_q, h2_s, None, rows, F, precision, False)


def swiglu_backward_quantize(h1: torch.Tensor, gh2: torch.Tensor, gh1: torch.Tensor,
                             gh1_q: torch.Tensor, gh1_s: torch.Tensor, *, precision: str,
                             h2: torch.Tensor | None = None) -> None:
    """Backward (module docstring): ``gh1 [R, 2F]`` bf16, ``gh1_q [R, 2F]`` and ``gh1_s
    [R, 2F/B]`` from ``h1 [R, 2F]`` and ``gh2 [R, F]`` (bf16); with ``h2`` (bf16 ``[R, F]``)
    also the forward's h2 again. All contiguous on one device; nothing allocated."""
    rows, F, _ = _check(precision, h1, gh1_q, gh1_s, 2)
    check_tensor("gh2", gh2, dtypes=(torch.bfloat16,), shape=[rows, F], shape_text="[R, F]")
    check_tensor("gh1", gh1, dtypes=(torch.bfloat16,), shape=[rows, 2 * F],
                 shape_text="[R, 2F]")
    tensors = {"h1": h1, "gh2": gh2, "gh1": gh1, "gh1_q": gh1_q, "gh1_s": gh1_s}
    if h2 is not None:
        check_tensor("h2", h2, dtypes=(torch.bfloat16,), shape=[rows, F], shape_text="[R, F]")
        tensors["h2"] = h2
    check_devices(tensors)
    _launch(h1, gh2, gh1, gh1_q, gh1_s, h2, rows, F, precision, True)


def swiglu_quantize_ref(h1: torch.Tensor, precision: str):
    """Plain PyTorch forward: ``(h2, h2_q, h2_s)`` (the bf16 values quantised by the
    precision's reference quantiser)."""
    from distmoe.quant import fp8_block_quantize_ref, mxfp8_quantize_ref, mxfp8_rebase

    F = h1.shape[1] // 2
    g, u = h1[:, :F].float(), h1[:, F:].float()
    h2 = (g * torch.sigmoid(g) * u).bfloat16()
    if precision == "fp8_block":
        return (h2, *fp8_block_quantize_ref(h2))
    q, s = mxfp8_quantize_ref(h2)
    if precision == "mxfp8_rebased":
        q, s, _ = mxfp8_rebase(q, s)
    return h2, q, s


def swiglu_backward_ref(h1: torch.Tensor, gh2: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch backward: ``gh1 [R, 2F]`` bf16 (module docstring's formula)."""
    F = h1.shape[1] // 2
    g, u, d = h1[:, :F].float(), h1[:, F:].float(), gh2.float()
    s = torch.sigmoid(g)
    return torch.cat([d * u * s * (1 + g * (1 - s)), d * g * s], 1).bfloat16()
