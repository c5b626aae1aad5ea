"""The fused SwiGLU + FP8 quantisation kernels (``distmoe.kernels.scaled.swiglu_quant``) on
fresh random rows (magnitudes spread over 2^-6..2^6 so that blocks get different scales),
outputs poisoned first:

* the quantised result is bit for bit the precision's quantiser (``mxfp8_quantize_2d`` /
  ``fp8_block_quantize_2d``) applied to the bf16 values the kernel stored;
* those bf16 values are within one bf16 step (2^-8 relative) of the plain-PyTorch formula:
  both compute in fp32 with a different sigmoid and operation order (a few fp32 roundings,
  2^-22 relative), so only a rounding to bf16 that falls the other way can differ."""

from __future__ import annotations

import pytest
import torch

from distmoe.kernels.scaled.swiglu_quant import (
    swiglu_backward_quantize,
    swiglu_backward_ref,
    swiglu_quantize,
    swiglu_quantize_ref,
)
from distmoe.quant.fp8_block import fp8_block_quantize_2d
from distmoe.quant.mxfp8 import mxfp8_quantize_2d, mxfp8_quantize_rebased_2d

QUANT = {"mxfp8": (32, torch.uint8, mxfp8_quantize_2d),
         "mxfp8_rebased": (128, torch.uint8, mxfp8_quantize_rebased_2d),
         "fp8_block": (128, torch.float32, fp8_block_quantize_2d)}
PRECISIONS = list(QUANT)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, cols, generator=g)
    return (v * torch.exp2(torch.randint(-6, 7, (rows, cols // 32), generator=g).float())
            .repeat_interleave(32, 1)).bfloat16().to(DEV)


def _poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device=DEV)
    t.view(torch.uint8).fill_(0xFF)  # NaN in every float format here
    return t


def _close_bf16(got, want):
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0**-126))) - 7)
    return bool(((got.float() - want.float()).abs() <= ulp).all())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_quantises_what_it_stores(precision):
    B, sdtype, quantize = QUANT[precision]
    R, F = 19, 2 * B  # a partial row block
    h1 = _rows(R, 2 * F, 1)
    h2, q, s = _poisoned((R, F), torch.bfloat16), _poisoned((R, F), torch.float8_e4m3fn), \
        _poisoned((R, F // B), sdtype)
    swiglu_quantize(h1, h2, q, s, precision=precision)
    want_h2 = swiglu_quantize_ref(h1, precision)[0]
    assert _close_bf16(h2, want_h2)
    q2, s2 = torch.empty_like(q), torch.empty_like(s)
    quantize(h2, q2, s2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), s2.view(torch.uint8))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_backward_quantises_what_it_stores(precision):
    B, sdtype, quantize = QUANT[precision]
    R, F = 19, B
    h1, gh2 = _rows(R, 2 * F, 2), _rows(R, F, 3)
    gh1 = _poisoned((R, 2 * F), torch.bfloat16)
    q, s = _poisoned((R, 2 * F), torch.float8_e4m3fn), _poisoned((R, 2 * F // B), sdtype)
    h2 = _poisoned((R, F), torch.bfloat16)
    swiglu_backward_quantize(h1, gh2, gh1, q, s, precision=precision, h2=h2)
    assert _close_bf16(gh1, swiglu_backward_ref(h1, gh2))
    assert _close_bf16(h2, swiglu_quantize_ref(h1, precision)[0])
    q2, s2 = torch.empty_like(q), torch.empty_like(s)
    quantize(gh1, q2, s2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), s2.view(torch.uint8))


def test_refusals():
    h1 = torch.zeros(4, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"F a positive multiple of 32"):
        swiglu_quantize(h1, torch.zeros(4, 24, dtype=torch.bfloat16),
                        torch.zeros(4, 24, dtype=torch.float8_e4m3fn),
                        torch.zeros(4, 1, dtype=torch.uint8), precision="mxfp8")
    with pytest.raises(ValueError, match=r"precision \('nvfp4'\) must be one of"):
        swiglu_quantize(h1, h1, h1, h1, precision="nvfp4")
