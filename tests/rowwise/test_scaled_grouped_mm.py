"""``distmoe.rowwise.scaled_grouped_mm``: FP8 forward and input gradient, bf16 weight gradient
(CPU, Triton's interpreter), against the recipe in plain PyTorch: the reference quantisers'
values (``mxfp8_quantize_ref`` / ``fp8_block_quantize_ref``, weights by
``prepare_weights(reference=True)``'s block rule), float64 products per group, rounded to
bf16. Bound: every element within 2^-7 of its tensor's largest magnitude: the kernel is
exact on the quantised operands up to fp32 summation order (docs/numerics.md section 6) and
one bf16 rounding (2^-8), which the reference rounds too, so they differ where that rounding
falls the other way: at most one bf16 step of the element. Rows of no group are zeros; the
``wgrad_sink`` adds the same gradient in fp32 into its buffer."""

from __future__ import annotations

import pytest
import torch

from distmoe.quant import fp8_block_quantize_ref, mxfp8_quantize_ref
from distmoe.quant.fp8_block import fp8_block_dequantize, fp8_block_quantize_weight
from distmoe.quant.mxfp8 import mxfp8_dequantize
from distmoe.quant.mxfp8_weight import mxfp8_quantize_weight_ref
from distmoe.rowwise import scaled_grouped_mm

TOL = 2.0**-7


def _q_rows(x, precision):
    if precision == "mxfp8":
        return mxfp8_dequantize(*mxfp8_quantize_ref(x), dtype=torch.float32).double()
    return fp8_block_dequantize(*fp8_block_quantize_ref(x), dtype=torch.float64)


def _q_weight(w, precision):  # w [E, N, K]
    if precision == "mxfp8":
        q = mxfp8_quantize_weight_ref(w)
        s = q.scales.repeat_interleave(32, -1).repeat_interleave(32, -2)
        return q.qdata.double() * torch.exp2(s.double() - 127)
    return fp8_block_dequantize(*fp8_block_quantize_weight(w), dtype=torch.float64)


def _reference(a, b, offs, gy, precision):
    """(out, grad_a, grad_b) of the recipe; b [E, K, N]."""
    aq, wq = _q_rows(a, precision), _q_weight(b.transpose(1, 2).contiguous(), precision)
    gq = _q_rows(gy, precision)
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    ga = torch.zeros(a.shape, dtype=torch.float64)
    gb = torch.zeros(b.shape, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = aq[start:end] @ wq[e].T
        ga[start:end] = gq[start:end] @ wq[e]
        gb[e] = aq[start:end].T @ gy[start:end].double()
        start = end
    return out, ga, gb


def _close(name, got, want):
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= TOL * scale, f"{name}: {err:.3g} (bound {TOL} x {scale:.3g})"


@pytest.mark.parametrize("precision,transposed", [("mxfp8", True), ("mxfp8", False),
                                                  ("fp8_block", True)])
def test_forward_and_gradients_against_the_recipe(precision, transposed):
    B = 32 if precision == "mxfp8" else 128
    E, K, N, M = 3, 2 * B, B if precision == "fp8_block" else 3 * B, 40
    g = torch.Generator().manual_seed(7)
    a = torch.randn(M, K, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(E, N, K, generator=g) / K**0.5).bfloat16()
    b = (w.transpose(1, 2) if transposed else w.transpose(1, 2).contiguous()).requires_grad_()
    offs = torch.tensor([11, 11, 33], dtype=torch.int32)  # an empty group, 7 rows of none
    gy = torch.randn(M, N, generator=g).bfloat16()
    y = scaled_grouped_mm(a, b, offs, precision=precision)
    y.backward(gy)
    ref = _reference(a.detach(), b.detach(), offs, gy, precision)
    _close("out", y, ref[0])
    _close("grad a", a.grad, ref[1])
    _close("grad b", b.grad, ref[2])
    assert (y[33:] == 0).all() and (a.grad[33:] == 0).all() and (b.grad[1] == 0).all()
    assert b.grad.stride() == b.stride()
    # the same weight gradient added in fp32 into a sink of b's layout
    sink = torch.full_like(b, 0.25, dtype=torch.float32)
    if transposed:
        sink = torch.full_like(w, 0.25, dtype=torch.float32).transpose(1, 2)
    b2 = b.detach().requires_grad_()
    scaled_grouped_mm(a.detach(), b2, offs, precision=precision, wgrad_sink=sink).backward(gy)
    assert b2.grad is None
    _close("sink", sink - 0.25, ref[2])


def test_refusals():
    a = torch.zeros(4, 48, dtype=torch.bfloat16)
    b = torch.zeros(2, 48, 32, dtype=torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"K \(a.shape\[1\]\) \(48\) must be a multiple of 32"):
        scaled_grouped_mm(a, b, offs)
    with pytest.raises(ValueError, match=r"precision \('fp4'\) must be"):
        scaled_grouped_mm(a, b, offs, precision="fp4")
    a = torch.zeros(4, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, 64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"wgrad_sink must have b's layout"):
        scaled_grouped_mm(a, b, offs, wgrad_sink=torch.zeros(2, 32, 64).transpose(1, 2))
