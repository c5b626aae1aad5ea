"""scaled_wgrad: the FP8 weight gradient (reduction along tokens, 128-token scale blocks) against
the float64 product of its dequantised operands, on fresh random rows quantised by
quantize_tokens (padding rows zeros), with an expert of no tokens, partial token blocks and
both scale formats; written (bf16, fp32) or accumulated into fp32; outputs poisoned first.

Bound (the 128-group arithmetic, docs/numerics.md section 6, with K the expert's tokens): every
E4M3 product is exact in fp32, a block's partial takes at most 127 additions, its promotion
the scale product's rounding (float32 scales), the multiply and the add, then n_b - 1
additions across blocks: ``(127 + n_b + 3) * 2^-24 * S`` with ``S`` the sum of |products|;
on SM90 the FP8 MMA chain adds its 13-fraction-bit accumulation per 32-deep MMA
(test_mxfp8_grouped_mm.py's model); then the output's rounding (bf16: 2^-8 relative)."""

import pytest
import torch

from distmoe.kernels.scaled.token_quant import TOKEN_FORMATS, quantize_tokens
from distmoe.kernels.scaled.wgrad import ScaledWgradConfig, scaled_wgrad, scaled_wgrad_ref
from distmoe.kernels.scaled.wgrad import _dequantize_tokens as dequant

U32, U16, TC = 2.0**-24, 2.0**-8, 2.0**-13


def _operands(live, m, n, fmt, device):
    g = torch.Generator().manual_seed(m + n)
    padded, act = [0], [0]
    for c in live:
        padded.append(padded[-1] + -(-c // 128) * 128)
        act.append(act[-1] + c)
    po, ro = (torch.tensor(v, dtype=torch.int32, device=device) for v in (padded, act))
    r_cap = padded[-1] + 128
    out = []
    for width, scale in ((m, 4.0), (n, 0.01)):
        rows = (torch.randn(act[-1], width, generator=g) * scale).bfloat16().to(device)
        q = torch.empty(width, r_cap, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(r_cap // 128, width, dtype=TOKEN_FORMATS[fmt], device=device)
        quantize_tokens(rows, po, ro, q, s, format=fmt)
        out += [q, s]
    return out, po, padded


def _bound(a, b, padded, gpu):
    tol = []
    for e in range(len(padded) - 1):
        lo, hi = padded[e], padded[e + 1]
        s_abs = a[:, lo:hi].abs() @ b[:, lo:hi].abs().T
        t = (127 + (hi - lo) // 128 + 3) * U32 * s_abs
        if gpu and hi > lo:  # (an expert without tokens: exactly zero)
            t = t + 4 * TC * s_abs + 32 * TC * (a[:, lo:hi].abs().amax(1)[:, None]
                                                 * b[:, lo:hi].abs().amax(1)[None, :]) \
                * max(1, (hi - lo) // 32)
        tol.append(t)
    return torch.stack(tol)


def _run(fmt, live, m, n, device="cpu", config=None, out_dtype=torch.bfloat16):
    (aq, as_, bq, bs), po, padded = _operands(live, m, n, fmt, device)
    if config is None and device == "cpu":
        config = ScaledWgradConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    E = len(live)
    out = torch.full((E, m, n), float("nan"), dtype=out_dtype, device=device)
    scaled_wgrad(aq, as_, bq, bs, po, out, format=fmt, config=config)
    a, b = dequant(aq, as_, fmt), dequant(bq, bs, fmt)
    exact = torch.stack([a[:, lo:hi] @ b[:, lo:hi].T
                         for lo, hi in zip(padded[:-1], padded[1:], strict=True)])
    tol = _bound(a, b, padded, device != "cpu")
    rnd = U16 if out_dtype == torch.bfloat16 else U32
    err = (out.double() - exact).abs()
    assert (err <= tol + rnd * (exact.abs() + tol) + 2.0**-133).all(), \
        f"max excess {(err - tol - rnd * exact.abs()).max().item()}"
    # the reference meets the same bound
    ref = torch.full_like(out, float("nan"))
    scaled_wgrad_ref(aq, as_, bq, bs, po, ref, format=fmt)
    assert ((ref.double() - exact).abs() <= tol + rnd * (exact.abs() + tol) + 2.0**-133).all()
    # accumulate: fp32 out += the product
    base = torch.randn(E, m, n, device=device)
    acc = base.clone()
    scaled_wgrad(aq, as_, bq, bs, po, acc, format=fmt, config=config, accumulate=True)
    err = (acc.double() - base.double() - exact).abs()
    assert (err <= tol + U32 * (exact.abs() + base.double().abs() + tol) * 2 + 2.0**-133).all()


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8_rebased"])
def test_scaled_wgrad_matches_exact_product(fmt):
    _run(fmt, (130, 0, 50), 64, 96)


def test_scaled_wgrad_fp32_out():
    _run("fp8_block", (1, 129), 32, 32, out_dtype=torch.float32)


def test_scaled_wgrad_refusals():
    (aq, as_, bq, bs), po, _ = _operands((5,), 32, 32, "fp8_block", "cpu")
    out = torch.zeros(1, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"format \('mxfp8'\) must be one of"):
        scaled_wgrad(aq, as_, bq, bs, po, out, format="mxfp8")
    with pytest.raises(TypeError, match=r"out must have dtype float32"):
        scaled_wgrad(aq, as_, bq, bs, po, out, format="fp8_block", accumulate=True)
    with pytest.raises(ValueError, match=r"bt_s must have shape \[2, 32\]"):
        scaled_wgrad(aq, as_, bq, bs.T.contiguous(), po, out, format="fp8_block")
    with pytest.raises(ValueError, match=r"out must have shape \[1, 32, 32\]"):
        scaled_wgrad(aq, as_, bq, bs, po, out[:, :16].contiguous(), format="fp8_block")


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8_rebased"])
def test_gpu_scaled_wgrad(fmt, gluon):
    cfg = ScaledWgradConfig(gluon=gluon, num_stages=5 if gluon else 3)
    _run(fmt, (700, 0, 129, 1500, 64), 256, 384, device="cuda", config=cfg)
