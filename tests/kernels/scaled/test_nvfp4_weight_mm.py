"""NVFP4-weight grouped GEMM (distmoe.kernels.scaled.nvfp4) against plain PyTorch.

The kernel decodes each weight to ``v * s_b`` (exact in bf16: module docstring of
distmoe.kernels.scaled.nvfp4, and :func:`test_decoded_weights_exact_in_bf16` below checks the
range argument over every E2M1 code and E4M3 byte), takes bf16 dots into fp32 (every product
exact), multiplies by the expert's global scale and rounds once to bf16. So against the
float64 product of the same bf16 rows and decoded weights, times ``s_g``, the only error is
the fp32 summation order and the two roundings (:func:`_bound`). The identity-operand test
isolates one product per output and is compared bit for bit (NaN scales included). Outputs
are poisoned with NaN first: every live row must be written, every other row left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from distmoe.kernels.scaled import (
    ScaledGemmConfig,
    nvfp4_weight_grouped_mm,
    nvfp4_weight_grouped_mm_ref,
)
from distmoe.kernels.scaled.nvfp4 import nvfp4_weight_values
from distmoe.quant import nvfp4_quantize_ref
from distmoe.quant.formats import E2M1_VALUES

# huge negative SwiGLU gates from the outliers: numpy's exp overflows under the interpreter
# (sigmoid -> 0, the right limit)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

U32 = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-8  # bf16 unit roundoff
EPS_SWIGLU = 2.0**-16  # the fp32 SwiGLU epilogue's few roundings and its exp, relative
SILU_SLOPE = 1.1  # max |silu'| over all g
SILU_FLUSH = 2.0**-118  # fp32 silu(g) flushes to 0 for g < -87: absolute error <= this |u|


@dataclass(frozen=True)
class Case:
    counts: tuple[int, ...]  # live rows per expert
    k: int
    n: int  # weight rows per expert (2F with swiglu)
    swiglu: bool = False
    w13_view: bool = False  # pass the weights as w13's [E, 2, F, K/2] (swiglu)
    spare_rows: int = 3  # rows of capacity beyond the live ones (left untouched)
    extra_pad: int = 0  # whole padding tiles added to expert 0's segment
    block_m: int = 16  # the padding multiple of the segments
    block_n: int = 32
    block_k: int = 64
    tile_m: int | None = None  # the kernel's block_m where smaller than the padding multiple
    swap_ab: bool = False  # the transposed tile (ScaledGemmConfig.swap_ab)


def _layout(counts, block_m, extra_pad=0):
    """``(padded_offsets, row_offsets)`` int32: each expert's rows padded to ``block_m``."""
    c = torch.tensor(counts, dtype=torch.int64)
    padded = (c + block_m - 1) // block_m * block_m
    padded[0] += extra_pad * block_m
    row_offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    row_offsets[1:] = c.cumsum(0)
    padded_offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    padded_offsets[1:] = padded.cumsum(0)
    return padded_offsets, row_offsets


def _quantize_experts(w):
    """NVFP4 weights with one global scale per expert (as prepare_weights; the plain-PyTorch
    quantiser, the same bits as the kernel and faster under the interpreter): packed,
    scales, global [E]."""
    E, n, k = w.shape
    packed, scales, gs = nvfp4_quantize_ref(w.reshape(E, -1), dim=-1, per="row")
    return packed.view(E, n, k // 2), scales.view(E, n, k // 16), gs.reshape(E)


def _operands(rows, k, num_experts, n, device="cpu"):
    """bf16 rows with one outlier (x 2^8) in every third row; weights with one outlier (x 2^6)
    per 16-value block, the experts' magnitudes 2^-3 apart (distinct global scales)."""
    a = torch.randn(rows, k, device=device)
    a[::3, 0] *= 2.0**8
    w = torch.randn(num_experts, n, k, device=device) / math.sqrt(k)
    blocks = w.view(num_experts, n, k // 16, 16)
    pick = torch.randint(0, 16, blocks.shape[:-1] + (1,), device=device)
    blocks.scatter_(-1, pick, blocks.gather(-1, pick) * 2.0**6)
    w *= 2.0 ** (-3 * torch.arange(num_experts, device=device)).view(-1, 1, 1)
    return (a.bfloat16(), *_quantize_experts(w.bfloat16()))


def _bound(a, w, s_g, gpu, scale_roundings=1, rel=None):
    """|kernel - exact| before the bf16 rounding, for ``a [M, K] @ w [N, K]^T`` (float64,
    decoded) times ``s_g``: every product is exact in fp32; an element passes through at most
    K additions (K - 1 inside the dots, one per K tile into the accumulator: fewer than K + 1
    in all), each rounding relatively by u; then one rounding by the global scale:
    ((K + 1) u S + u |acc|) s_g <= (K + 2) u S s_g with S = sum |a_k w_k| (first order; 1.01
    covers the second). The GPU's bf16 WGMMA adds in fp32 (a margin of the same size again
    is allowed: a model to confirm there). With a per-row activation scale the scale is a
    product of two fp32 values first (``scale_roundings=2``: one more u). ``rel``: another
    kernel's accumulation bound in units of S (the scale roundings are added to it)."""
    k = a.shape[1]
    if rel is None:
        rel = (k + 1 + scale_roundings) * U32 * (2 if gpu else 1)
    else:
        rel = rel + scale_roundings * U32
    return 1.01 * rel * (a.abs() @ w.abs().T) * s_g + 2.0**-149


def _expected_and_bound(a, w, s_g, padded_offsets, row_offsets, out_n, swiglu, gpu,
                        scale_roundings=1, rel=None):
    rows = int(row_offsets[-1])
    exact = torch.zeros(rows, out_n, dtype=torch.float64, device=a.device)
    tol = torch.zeros_like(exact)
    ro = row_offsets.tolist()
    for e in range(len(ro) - 1):
        lo, hi = ro[e], ro[e + 1]
        if lo == hi:
            continue
        acc = (a[lo:hi] @ w[e].T) * s_g[e]
        gamma = _bound(a[lo:hi], w[e], s_g[e], gpu, scale_roundings, rel)
        if swiglu:
            g, u = acc[:, :out_n], acc[:, out_n:]
            gg, gu = gamma[:, :out_n], gamma[:, out_n:]
            h = torch.nn.functional.silu(g) * u
            # slope of silu over [g - gg, g + gg]: below -1, |silu'(x)| <= sigmoid(x) (1 - x)
            top = g + gg
            slope = torch.where(top < -1, torch.sigmoid(top) * (1 - top), SILU_SLOPE)
            dh = slope * gg * (u.abs() + gu) + (torch.nn.functional.silu(g).abs()
                                                + slope * gg) * gu
            dh = dh + EPS_SWIGLU * (h.abs() + dh) + SILU_FLUSH * (u.abs() + gu)
            exact[lo:hi], err = h, dh
        else:
            exact[lo:hi], err = acc, gamma
        # one bf16 rounding (relative 2^-8; 2^-133 absolute below bf16's normal range)
        tol[lo:hi] = err + U16 * (exact[lo:hi].abs() + err) + 2.0**-133
    return exact, tol


def _check_output(out, exact, tol, row_offsets):
    live = int(row_offsets[-1])
    assert out[live:].isnan().all(), "rows beyond row_offsets[E] were written"
    got = out[:live].double()
    assert torch.isfinite(got).all(), "a live row was not written (NaN poison left)"
    err = (got - exact).abs()
    worst = (err - tol).max().item() if live else -1.0
    assert worst <= 0, (f"error above the bound: max |out - exact| = {err.max().item():.3g}, "
                        f"{(err / tol).max().item():.3g} x the bound")


def _run_case(case: Case, device="cpu", config=None, gpu=False, mx=False, row_scale=False):
    """One case against the float64 bound and the plain-PyTorch reference. ``mx``: MXFP4
    weights (E8M0 per 32, no global scale: the prologue's ``v * 2^(s - 127)`` is exact in
    bf16 too, so the same bound with ``s_g = 1``), else NVFP4. ``row_scale``: a float32
    factor per activation row (NVFP4 activation rows' global scales), over many decades."""
    from distmoe.kernels.scaled import mxfp4_weight_grouped_mm
    from distmoe.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize

    num_experts = len(case.counts)
    rows = sum(case.counts) + case.spare_rows
    padded_offsets, row_offsets = _layout(case.counts, case.block_m, case.extra_pad)
    a, packed, scales, s_g = _operands(rows, case.k, num_experts, case.n, device)
    group = 16
    if mx:
        g = torch.Generator().manual_seed(case.k + case.n)
        w = (torch.randn(num_experts, case.n, case.k, generator=g)
             * torch.logspace(-3, 3, case.k)).bfloat16().to(device)
        packed, scales = mxfp4_quantize(w)
        s_g, group = None, 32
    out_n = case.n // 2 if case.swiglu else case.n
    if config is None:
        config = ScaledGemmConfig(block_m=case.tile_m or case.block_m, block_n=case.block_n,
                                  block_k=case.block_k, num_warps=4, num_stages=2,
                                  swap_ab=case.swap_ab)
    tables = (padded_offsets.to(device), row_offsets.to(device))
    bp, bs = packed, scales
    if case.w13_view:
        bp = packed.view(num_experts, 2, out_n, case.k // 2)
        bs = scales.view(num_experts, 2, out_n, case.k // group)
    out = torch.full((rows, out_n), float("nan"), dtype=torch.bfloat16, device=device)
    rs = None
    if row_scale:
        g = torch.Generator().manual_seed(rows)
        rs = (torch.exp2(torch.randint(-12, 12, (rows,), generator=g).float())
              * (1 + torch.rand(rows, generator=g))).to(device)
    if mx:
        mxfp4_weight_grouped_mm(a, bp, bs, *tables, out, swiglu=case.swiglu, config=config)
        w = mxfp4_dequantize(packed, scales, dtype=torch.float64).cpu()
        sg64 = torch.ones(num_experts, dtype=torch.float64)
    else:
        nvfp4_weight_grouped_mm(a, bp, bs, s_g, *tables, out, swiglu=case.swiglu, config=config,
                                a_row_scale=rs)
        w = nvfp4_weight_values(packed, scales).double().cpu()
        sg64 = s_g.double().cpu()
    a64 = a.double().cpu()
    if rs is not None:  # exact in float64: the factor moves onto the rows
        a64 = a64 * rs.double().cpu()[:, None]
    exact, tol = _expected_and_bound(a64, w, sg64, padded_offsets, row_offsets, out_n,
                                     case.swiglu, gpu, scale_roundings=1 if rs is None else 2)
    _check_output(out.cpu(), exact, tol, row_offsets)
    # the plain-PyTorch reference: same contract, same bound
    ref = torch.full_like(out, float("nan"))
    nvfp4_weight_grouped_mm_ref(a, bp, bs, s_g, *tables, ref, swiglu=case.swiglu,
                                block_m=case.block_m, a_row_scale=rs)
    _check_output(ref.cpu(), exact, tol, row_offsets)

CASES = {
    # an empty expert between two others; partial row tiles; K = 80 and N = 48 not multiples
    # of block_k = 64 / block_n = 32
    "partial_tiles": Case(counts=(5, 0, 19), k=80, n=48),
    # SwiGLU on w13's own [E, 2, F, K/2] layout; F = 40 a partial column tile; experts empty
    # first and last
    "swiglu_w13": Case(counts=(0, 17, 3, 0), k=64, n=80, swiglu=True, w13_view=True),
    # segments padded beyond the minimum (the grid's row tiles walk further); block_k = 32
    "extra_padding": Case(counts=(7, 2), k=32, n=32, extra_pad=1, block_k=32),
    # no live row at all: nothing written
    "no_rows": Case(counts=(0, 0), k=16, n=32, block_k=32),
    # 16-row tiles inside segments padded to 64 (decode: a few live rows per segment), a
    # segment of 70 rows over two padded blocks
    "tiles_inside_padding": Case(counts=(3, 0, 70), k=64, n=32, block_m=64, tile_m=16),
    # the transposed tile (weights as the dot's first operand): partial tiles, K = 80 not a
    # multiple of block_k; SwiGLU with a partial column tile; 16-row tiles in 64-row padding
    "swap_partial": Case(counts=(5, 0, 19), k=80, n=48, swap_ab=True),
    "swap_swiglu": Case(counts=(0, 17, 3, 0), k=64, n=80, swiglu=True, w13_view=True,
                        swap_ab=True),
    "swap_inside_padding": Case(counts=(3, 0, 70), k=64, n=64, block_m=64, tile_m=16,
                                swap_ab=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_float64_within_bound(name):
    _run_case(CASES[name])


@pytest.mark.parametrize("name", ["partial_tiles", "swiglu_w13", "swap_swiglu"])
def test_row_scale_against_float64_within_bound(name):
    _run_case(CASES[name], row_scale=True)


@pytest.mark.parametrize("form", ["plain", "swapped", "mxfp4", "fp8_operands"])
def test_split_k_form_within_bound(form):
    """``config.interleave_k=False``: two dots per weight tile, one per K parity, over the
    even and odd activation columns loaded apart (the default interleaves the decoded
    weights into K order and takes one dot): the same float64 bound and the same reference,
    with partial tiles and, but for the FP8 operands (whole 128-wide groups), a masked K
    tail."""
    from test_nvfp4_fp8_mm import CASES as FP8_CASES
    from test_nvfp4_fp8_mm import _run as run_fp8

    case = {"plain": CASES["partial_tiles"], "swapped": CASES["swap_swiglu"],
            "mxfp4": MX_CASES["partial_tiles"], "fp8_operands": FP8_CASES["swiglu_w13"]}[form]
    cfg = ScaledGemmConfig(block_m=case.tile_m or case.block_m, block_n=case.block_n,
                           block_k=128 if form == "fp8_operands" else case.block_k,
                           num_warps=4, num_stages=2, swap_ab=case.swap_ab, interleave_k=False)
    if form == "fp8_operands":
        run_fp8(case, config=cfg)
    else:
        _run_case(case, config=cfg, mx=form == "mxfp4")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scales_off_a_word_boundary(device):
    """Block scales that start off a 4-byte boundary (a view into a larger buffer): the
    kernel reads scale rows as 4-byte words, so the launcher hands it an aligned copy (on a
    GPU a misaligned word load faults; the interpreter would read it like x86); the output
    is the aligned scales' output, bit for bit."""
    from distmoe.kernels.scaled.nvfp4 import check_nvfp4_weight_grouped_mm_args

    counts, k, n = (5, 0, 19), 128, 64
    padded_offsets, row_offsets = (t.to(device) for t in _layout(counts, 32))
    a, packed, scales, s_g = _operands(sum(counts), k, len(counts), n, device)
    raw = scales.view(torch.uint8)
    buffer = torch.empty(raw.numel() + 1, dtype=torch.uint8, device=device)
    buffer[1:] = raw.flatten()
    shifted = buffer[1:].view(raw.shape).view(scales.dtype)
    assert shifted.data_ptr() % 4 == 1
    out = torch.empty(sum(counts), n, dtype=torch.bfloat16, device=device)
    given = check_nvfp4_weight_grouped_mm_args(a, packed, shifted, s_g, padded_offsets,
                                               row_offsets, out, swiglu=False, mx=False)[1]
    assert given.data_ptr() % 4 == 0 and torch.equal(given, raw)
    cfg = ScaledGemmConfig(block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=2)
    outs = []
    for sc in (scales, shifted):
        out = torch.full((sum(counts), n), float("nan"), dtype=torch.bfloat16, device=device)
        nvfp4_weight_grouped_mm(a, packed, sc, s_g, padded_offsets, row_offsets, out,
                                config=cfg)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert not outs[0][:5].isnan().any()


def test_decoded_weights_exact_in_bf16():
    # the range argument: every E2M1 value (2 significant bits, 0.5 to 6) times every finite
    # E4M3 scale (at most 4 significant bits, 2^-9 to 448) has at most 6 significant bits and
    # lies in [2^-10, 2688]: a normal bf16, exact
    codes = torch.arange(16, dtype=torch.uint8)
    scale_bytes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(scale_bytes.numel(), 1)  # [254, 8]
    scales = scale_bytes.view(torch.float8_e4m3fn).view(-1, 1)
    vals = nvfp4_weight_values(packed, scales)  # [254, 16]
    assert torch.equal(vals.bfloat16().float(), vals)
    nz = vals[vals != 0].abs()
    assert nz.min().item() == 2.0**-10 and nz.max().item() == 6 * 448
    table = torch.tensor(E2M1_VALUES)
    expect = torch.cat([table, -table]).view(1, 16) * scales.float()
    assert torch.equal(vals, expect)


def test_decode_bit_exact_every_code_and_scale():
    # identity rows pick single weights: out[r, n] = w[n, r] * s_g with one product per
    # output, so the result is exact; all 256 scale bytes (NaN codes 0x7F / 0xFF make their
    # row's outputs NaN: 0 x NaN in the other products) and random packed bytes
    k, n = 32, 128
    packed = torch.randint(0, 256, (1, n, k // 2), dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.uint8).view(1, n, k // 16).view(torch.float8_e4m3fn)
    s_g = torch.tensor([2.0**-5], dtype=torch.float32)
    a = torch.eye(k, dtype=torch.bfloat16)
    po, ro = _layout((k,), 16)
    out = torch.full((k + 2, n), float("nan"), dtype=torch.bfloat16)
    a_pad = torch.cat([a, torch.zeros(2, k, dtype=torch.bfloat16)])
    nvfp4_weight_grouped_mm(a_pad, packed, scales, s_g, po, ro, out,
                            config=ScaledGemmConfig(block_m=16, block_n=32, block_k=32,
                                                    num_warps=4, num_stages=1))
    w = nvfp4_weight_values(packed, scales)[0].double()  # [n, k]
    expect = ((a.double() @ w.T) * 2.0**-5).bfloat16()
    got = out[:k]
    same = (got.view(torch.int16) == expect.view(torch.int16)) | (got.isnan() & expect.isnan())
    assert same.all()
    assert got.isnan().any() and out[k:].isnan().all()


def test_argument_errors():
    E, n, k, R = 2, 32, 32, 8
    a = torch.zeros(R, k, dtype=torch.bfloat16)
    packed = torch.zeros(E, n, k // 2, dtype=torch.uint8)
    scales = torch.zeros(E, n, k // 16, dtype=torch.float8_e4m3fn)
    gs = torch.ones(E)
    po, ro = _layout((4, 4), 16)
    out = torch.zeros(R, n, dtype=torch.bfloat16)

    def call(**kw):
        args = dict(a=a, b_packed=packed, b_block_scales=scales, b_global=gs,
                    padded_offsets=po, row_offsets=ro, out=out)
        swiglu = kw.pop("swiglu", False)
        config = kw.pop("config", None)
        args.update(kw)
        return nvfp4_weight_grouped_mm(*args.values(), swiglu=swiglu, config=config)

    with pytest.raises(TypeError, match="a must have dtype bfloat16"):
        call(a=a.float())
    with pytest.raises(ValueError, match=r"K \(24, a.shape\[1\]\) must be a positive multiple "
                                         "of 16"):
        call(a=torch.zeros(R, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"b_packed must have K/2 = 16 bytes"):
        call(b_packed=torch.zeros(E, n, k, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"b_block_scales must have shape \[2, 32, 2\]"):
        call(b_block_scales=scales[:, :, :1].contiguous())
    with pytest.raises(ValueError, match=r"b_global must have shape \[2\]"):
        call(b_global=torch.ones(E, 1))
    with pytest.raises(TypeError, match="b_global must have dtype float32"):
        call(b_global=gs.double())
    with pytest.raises(ValueError, match=r"out must have shape \[8, 16\]"):
        call(swiglu=True)
    with pytest.raises(ValueError, match=r"N \(3, b_packed.shape\[1\]\) must be 2F"):
        call(b_packed=packed[:, :3].contiguous(), b_block_scales=scales[:, :3].contiguous(),
             out=torch.zeros(R, 1, dtype=torch.bfloat16), swiglu=True)
    with pytest.raises(TypeError, match="swiglu must be a bool"):
        call(swiglu=1)
    with pytest.raises(TypeError, match="config must be a ScaledGemmConfig"):
        call(config={"block_m": 16})
    with pytest.raises(ValueError, match=r"row_offsets must have shape \[3\]"):
        call(row_offsets=ro[:2].contiguous())


@pytest.mark.gpu
def test_gpu_moderate_shape():
    """One GPU: ~1000 rows over 8 experts (two empty), K = 512, N = 512 and SwiGLU
    F = 256 at the default configs (bound with the GPU margin of :func:`_bound`)."""
    counts = (300, 0, 17, 129, 1, 0, 260, 255)
    for case in (Case(counts=counts, k=512, n=512, block_m=128),
                 Case(counts=counts, k=512, n=512, swiglu=True, w13_view=True, block_m=128)):
        from distmoe.kernels.scaled import nvfp4_weight_config
        cfg = nvfp4_weight_config(k=case.k, n=case.n, swiglu=case.swiglu, block_m=128)
        _run_case(case, device="cuda", config=cfg, gpu=True)
        _run_case(case, device="cuda", config=cfg, gpu=True, row_scale=True)
        # the transposed tile, 16 token rows inside the 128-row padding
        swapped = ScaledGemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4,
                                   num_stages=3, swap_ab=True)
        _run_case(case, device="cuda", config=swapped, gpu=True, row_scale=True)


# ---------------------------------------------------------------------------- MXFP4 weights
MX_CASES = {
    # K = 96 (a partial K tile of 64), N = 48 (a partial column tile), an empty expert
    "partial_tiles": Case(counts=(5, 0, 19), k=96, n=48),
    # SwiGLU on w13's [E, 2, F, K/2] layout, F = 40 a partial column tile
    "swiglu_w13": Case(counts=(0, 17, 3), k=64, n=80, swiglu=True, w13_view=True),
}


MX_CASES["swap_swiglu"] = Case(counts=(0, 17, 3), k=64, n=80, swiglu=True, w13_view=True,
                               swap_ab=True)


@pytest.mark.parametrize("name", list(MX_CASES))
def test_mxfp4_against_float64_within_bound(name):
    _run_case(MX_CASES[name], mx=True)


def test_mxfp4_refusals():
    from distmoe.kernels.scaled import mxfp4_weight_grouped_mm
    po, ro = _layout((3,), 16)
    a = torch.zeros(3, 64, dtype=torch.bfloat16)
    packed = torch.zeros(1, 32, 32, dtype=torch.uint8)
    out = torch.zeros(3, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"b_block_scales must have dtype uint8"):
        mxfp4_weight_grouped_mm(a, packed, torch.zeros(1, 32, 2, dtype=torch.float8_e4m3fn),
                                po, ro, out)
    with pytest.raises(ValueError, match=r"b_block_scales must have shape \[1, 32, 2\]"):
        mxfp4_weight_grouped_mm(a, packed, torch.zeros(1, 32, 4, dtype=torch.uint8), po, ro,
                                out)
    with pytest.raises(ValueError, match=r"K \(48, a.shape\[1\]\) must be a positive multiple "
                                         r"of 32"):
        mxfp4_weight_grouped_mm(a[:, :48].contiguous(), packed[..., :24].contiguous(),
                                torch.zeros(1, 32, 1, dtype=torch.uint8), po, ro, out)


@pytest.mark.gpu
def test_gpu_mxfp4_against_float64_within_bound():
    # GPT-OSS's widths: D = F = 2880, a partial 128-column tile
    case = Case(counts=(700, 0, 129, 300), k=2880, n=2880, block_m=128)
    cfg = ScaledGemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    _run_case(case, device="cuda", config=cfg, gpu=True, mx=True)
