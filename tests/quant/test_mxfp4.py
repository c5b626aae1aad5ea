"""MXFP4 (GPT-OSS's expert format): the quantiser's rule checked against an independent
brute-force reference (every E2M1 grid value's distance, ties to the even code; the scale by
direct search over exponents), bit for bit, on fresh random rows spanning 16 decades with an
all-zero block, NaN and -Inf blocks and -0.0; dequantisation, PreparedWeight's checks, and
the GPT-OSS checkpoint loader (interleaved gate/up rows) against prepare_weights."""

import math

import pytest
import torch

from distmoe.quant import PreparedWeight, prepare_weights
from distmoe.quant.formats import E2M1_VALUES
from distmoe.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)


def _brute(block: torch.Tensor) -> tuple[list[int], int]:
    """Codes and scale byte of one 32-value block, the slow way."""
    vals = block.double()
    if not torch.isfinite(vals).all():
        return [0] * 32, 255
    amax = vals.abs().max().item()
    e = -127
    if amax > 0:
        e = next(c for c in range(-127, 128) if amax <= 6 * 2.0**c)
    codes = []
    for v in vals.tolist():
        y = min(abs(v) / 2.0**e, 6.0)
        d = (GRID - y).abs()
        best = torch.nonzero(d == d.min()).flatten().tolist()
        code = best[0] if len(best) == 1 else next(c for c in best if c % 2 == 0)
        codes.append(code | (8 if math.copysign(1.0, v) < 0 else 0))
    return codes, e + 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_brute_force(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 128, generator=g) * torch.logspace(-8, 8, 128)[torch.randperm(128, generator=g)]
    x[0, :32] = 0.0
    x[1, 40] = float("nan")
    x[2, 70] = float("-inf")
    x[3, 5] = -0.0
    x[4, :32] = torch.tensor(E2M1_VALUES * 4) * 2.0**-3  # exactly representable, ties absent
    x[5, 0:32] = 6.0 * 2.0**5  # amax exactly 6 * 2^e
    x = x.to(dtype)
    packed, scales = mxfp4_quantize(x)
    assert packed.shape == (6, 64) and scales.shape == (6, 4)
    for r in range(6):
        for b in range(4):
            codes, sbyte = _brute(x[r, 32 * b:32 * b + 32])
            got = packed[r, 16 * b:16 * b + 16]
            got_codes = torch.stack((got & 15, got >> 4), -1).flatten().tolist()
            assert got_codes == codes, (r, b)
            assert int(scales[r, b]) == sbyte, (r, b)
    y = mxfp4_dequantize(packed, scales)
    assert torch.isnan(y[1, 32:64]).all() and torch.isnan(y[2, 64:96]).all()
    assert torch.equal(y[4, :32], x[4, :32].float())  # representable values round-trip


def test_quantize_along_another_dim_and_error_bound():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 3, generator=g)
    p, s = mxfp4_quantize(x, dim=0)
    p2, s2 = mxfp4_quantize(x.T.contiguous(), dim=-1)
    assert torch.equal(p, p2.T) and torch.equal(s, s2.T)
    y = mxfp4_dequantize(p, s, dim=0, dtype=torch.float64)
    e = torch.exp2(s.double() - 127).repeat_interleave(32, 0)
    # half a grid step times 2^e: 0.25 below 2 * 2^e, 0.5 below 4 * 2^e, 1 above
    step = torch.where(x.abs() < 2 * e, 0.25, torch.where(x.abs() < 4 * e, 0.5, 1.0)) * e
    assert ((y - x.double()).abs() <= step * (1 + 2.0**-20)).all()


def test_refusals():
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(48\) must be a positive multiple of 32"):
        mxfp4_quantize(torch.randn(2, 48))
    p, s = mxfp4_quantize(torch.randn(2, 64))
    with pytest.raises(ValueError, match="scales must have packed's shape"):
        mxfp4_dequantize(p, s[:, :1])
    with pytest.raises(ValueError, match=r"D \(48\) must be a multiple of 32 for precision "
                                         r"'mxfp4'"):
        prepare_weights(torch.randn(2, 2, 32, 48), torch.randn(2, 48, 32), "mxfp4")
    with pytest.raises(ValueError, match="global_scale must be None for precision 'mxfp4'"):
        PreparedWeight(p, s, (2, 64), "mxfp4", torch.ones(2))


def test_checkpoint_loader_equals_prepare_weights():
    # a GPT-OSS-style checkpoint: gate_up_proj rows interleaved (gate, up, gate, ...), blocks
    # [E, N, K/32, 16] and scales [E, N, K/32]; loaded without requantisation it is exactly
    # prepare_weights of the de-interleaved weights
    g = torch.Generator().manual_seed(6)
    E, F, D = 2, 32, 64
    w13 = torch.randn(E, 2, F, D, generator=g).bfloat16()
    w2 = torch.randn(E, D, F, generator=g).bfloat16()
    p13, p2 = prepare_weights(w13, w2, "mxfp4")
    inter = torch.stack((w13[:, 0], w13[:, 1]), 2).reshape(E, 2 * F, D)  # gate/up alternate
    q, s = mxfp4_quantize(inter)
    c13 = PreparedWeight.mxfp4(q.view(E, 2 * F, D // 32, 16), s, interleaved=True)
    q2, s2 = mxfp4_quantize(w2)
    c2 = PreparedWeight.mxfp4(q2.view(E, D, F // 32, 16), s2)
    assert c13.shape == p13.shape and torch.equal(c13.qdata, p13.qdata)
    assert torch.equal(c13.scales, p13.scales)
    assert torch.equal(c2.qdata, p2.qdata) and torch.equal(c2.scales, p2.scales)
    assert torch.equal(c13.dequantize(), mxfp4_dequantize(p13.qdata, p13.scales))
