"""MXFP8 grouped GEMM (distmoe.kernels.scaled) against plain PyTorch on the dequantised operands.

The kernel computes exact MXFP8 arithmetic up to the fp32 summation order (module docstring of
distmoe.kernels.scaled.triton), then one bf16 rounding. The random-data tests compare it with
the float64 product of the dequantised operands within the bound derived from that
(:func:`_bound`); the integer-data test chooses operands whose every partial sum is exact in
fp32 and compares bit for bit. Outputs are poisoned with NaN first: every live row must be
written, every other row left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from distmoe.kernels.scaled import ScaledGemmConfig, mxfp8_grouped_mm, mxfp8_grouped_mm_ref
from distmoe.quant import mxfp8_dequantize, mxfp8_quantize, mxfp8_quantize_weight

# SwiGLU of the outliers' huge gate values: numpy's exp overflows to inf under the
# interpreter (sigmoid -> 0, the right limit)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# fp32 and bf16 unit roundoffs (24 and 8 significant bits).
U32 = 2.0**-24
U16 = 2.0**-8
# Relative error of the fp32 SwiGLU epilogue (g * sigmoid(g) * u: a few fp32 roundings and
# an exp, which the GPU evaluates through a fast exp2 of g * log2(e)); far below bf16's.
EPS_SWIGLU = 2.0**-16
# max |d silu / dg| over all g (at g ~ 2.4: 1.0998)
SILU_SLOPE = 1.1
# fp32 SwiGLU flushes silu(g) to 0 once exp(-g) overflows (g < -88.7) or sigmoid(g) falls
# below fp32's normal range (flush-to-zero on the GPU): there |silu(g)| <= 89 * 2^-126
# < 2^-118, an absolute error of at most 2^-118 |u| (the fp32 reference does the same).
SILU_FLUSH = 2.0**-118
# Hopper FP8 MMA, per 32-deep step: products aligned and added with 13 fraction bits,
# truncated (module docstring): 32 * 2^-13 * max |product| + 2^-13 * |partial|.
TC_FRACTION_BITS = 13


@dataclass(frozen=True)
class Case:
    counts: tuple[int, ...]  # live rows per expert
    k: int
    n: int  # weight rows per expert (2F with swiglu)
    swiglu: bool = False
    spare_rows: int = 3  # rows of capacity beyond the live ones (left untouched)
    extra_pad: int = 0  # whole padding tiles added to expert 0's segment (beyond minimal)
    block_m: int = 16
    block_n: int = 32
    block_k: int = 64
    a_exp: int = 0  # odd activation rows scaled by 2^a_exp before quantisation
    b_exp: int = 0  # weights scaled by 2^b_exp


def _layout(counts, block_m, extra_pad=0):
    """``(padded_offsets, row_offsets)`` int32: each expert's rows padded to ``block_m``
    (expert 0 by ``extra_pad`` more tiles)."""
    c = torch.tensor(counts, dtype=torch.int64)
    padded = (c + block_m - 1) // block_m * block_m
    padded[0] += extra_pad * block_m
    row_offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    row_offsets[1:] = c.cumsum(0)
    padded_offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    padded_offsets[1:] = padded.cumsum(0)
    return padded_offsets, row_offsets


def _with_outliers(x: torch.Tensor, factor: float, block_dims: tuple[int, int]) -> torch.Tensor:
    """``x`` with one element of every ``block_dims`` block of its last two dims multiplied by
    ``factor`` (the block's scale then comes from it; its small neighbours lose bits or
    underflow to E4M3 subnormals and zeros)."""
    br, bc = block_dims
    *lead, rows, cols = x.shape
    tiles = x.reshape(*lead, rows // br, br, cols // bc, bc).movedim(-3, -2)
    flat = tiles.reshape(*lead, rows // br, cols // bc, br * bc)
    pick = torch.randint(0, br * bc, flat.shape[:-1] + (1,), device=x.device)
    flat = flat.scatter(-1, pick, flat.gather(-1, pick) * factor)
    return flat.reshape(*lead, rows // br, cols // bc, br, bc).movedim(-2, -3).reshape(x.shape)


def _random_operands(rows, k, num_experts, n, device="cpu", a_exp=0, b_exp=0):
    """Fresh random MXFP8 operands from distmoe.quant's quantisers (no zero blocks): one
    outlier (x 2^12) per 1 x 32 activation block and one (x 2^8) per 32 x 32 weight block;
    odd activation rows times 2^a_exp, weights times 2^b_exp. Quantised from bf16, or from
    fp32 when an exponent is given (bf16 has no subnormals below 2^-133)."""
    x = _with_outliers(torch.randn(rows, k, device=device), 2.0**12, (1, 32))
    x[1::2] *= 2.0**a_exp
    w = _with_outliers(torch.randn(num_experts, n, k, device=device) / math.sqrt(k), 2.0**8,
                       (32, 32)) * 2.0**b_exp
    dtype = torch.bfloat16 if a_exp == b_exp == 0 else torch.float32
    a_q, a_scales = mxfp8_quantize(x.to(dtype), dim=-1)
    w8 = mxfp8_quantize_weight(w.to(dtype))
    return a_q, a_scales, w8.qdata, w8.scales


def _dequantised(a_q, a_scales, b_q, b_scales):
    a = mxfp8_dequantize(a_q, a_scales, dim=-1).double()
    b = mxfp8_dequantize(b_q, b_scales.repeat_interleave(32, dim=-2), dim=-1).double()
    return a, b


def _step_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| over each 32-wide K step: ``[..., K] -> [..., K/32]``."""
    return x.abs().unflatten(-1, (-1, 32)).amax(-1)


def _accumulation_bound(a, b, gpu):
    """Bound on |fp32 accumulator - exact| for ``a [M, K] @ b [N, K]^T`` (float64 operands).

    Interpreter / fp32 order: each product is exact and passes through at most 31 additions
    in its step, one promotion (an exact power-of-two multiply, then an add: at most one
    rounding) and K/32 - 1 additions across steps: (31 + K/32 + 1) * u32 * sum |a_k b_k|
    (first order; the second-order term is below 1 % of it here). On the GPU add the FP8
    MMA's own error per step (TC_FRACTION_BITS), with max_k |a_k b_k| <= max |a| * max |b|
    over the step."""
    k = a.shape[1]
    s_abs = a.abs() @ b.abs().T
    bound = 1.01 * (31 + k // 32 + 1) * U32 * s_abs
    if gpu:
        t = 2.0**-TC_FRACTION_BITS
        bound = bound + 32 * t * (_step_max(a) @ _step_max(b).T) + t * s_abs
    return bound


def _expected_and_bound(a, b, padded_offsets, row_offsets, out_n, swiglu, gpu):
    """Per live row: the exact MXFP8 result (float64) and the kernel's error bound."""
    rows = int(row_offsets[-1])
    exact = torch.zeros(rows, out_n, dtype=torch.float64, device=a.device)
    tol = torch.zeros_like(exact)
    ro = row_offsets.tolist()
    for e in range(len(ro) - 1):
        lo, hi = ro[e], ro[e + 1]
        if lo == hi:
            continue
        acc = a[lo:hi] @ b[e].T
        gamma = _accumulation_bound(a[lo:hi], b[e], gpu)
        if swiglu:
            g, u = acc[:, :out_n], acc[:, out_n:]
            gg, gu = gamma[:, :out_n], gamma[:, out_n:]
            h = torch.nn.functional.silu(g) * u
            # |silu(g') u' - silu(g) u| <= slope * gg * (|u| + gu) + (|silu(g)| + slope gg) gu
            # with slope = max |silu'| over [g - gg, g + gg]: below -1, |silu'(x)| <=
            # sigmoid(x) (1 - x), which grows with x (the outliers make many g hugely negative)
            top = g + gg
            slope = torch.where(top < -1, torch.sigmoid(top) * (1 - top), SILU_SLOPE)
            dh = slope * gg * (u.abs() + gu) + (torch.nn.functional.silu(g).abs()
                                                + slope * gg) * gu
            dh = dh + EPS_SWIGLU * (h.abs() + dh) + SILU_FLUSH * (u.abs() + gu)
            exact[lo:hi], err = h, dh
        else:
            exact[lo:hi], err = acc, gamma
        # then one bf16 rounding (relative 2^-8; 2^-133 below bf16's normal range)
        tol[lo:hi] = err + U16 * (exact[lo:hi].abs() + err) + 2.0**-133
    return exact, tol


def _check_output(out, exact, tol, row_offsets):
    live = int(row_offsets[-1])
    assert out[live:].isnan().all(), "rows beyond row_offsets[E] were written"
    got = out[:live].double()
    assert torch.isfinite(got).all(), "a live row was not written (NaN poison left)"
    err = (got - exact).abs()
    worst = (err - tol).max().item() if live else -1.0
    assert worst <= 0, (
        f"error above the bound: max |out - exact| = {err.max().item():.3g}, "
        f"at most {(err / tol).max().item():.3g} x the bound")


def _run_case(case: Case, device="cpu", config=None, gpu=False):
    num_experts = len(case.counts)
    live = sum(case.counts)
    rows = live + case.spare_rows
    padded_offsets, row_offsets = _layout(case.counts, case.block_m, case.extra_pad)
    a_q, a_scales, b_q, b_scales = _random_operands(rows, case.k, num_experts, case.n, device,
                                                    case.a_exp, case.b_exp)
    out_n = case.n // 2 if case.swiglu else case.n
    if config is None:
        config = ScaledGemmConfig(block_m=case.block_m, block_n=case.block_n,
                                  block_k=case.block_k, num_warps=4, num_stages=2)
    tables = (padded_offsets.to(device), row_offsets.to(device))
    out = torch.full((rows, out_n), float("nan"), dtype=torch.bfloat16, device=device)
    mxfp8_grouped_mm(a_q, a_scales, b_q, b_scales, *tables, out, swiglu=case.swiglu,
                     config=config)
    a, b = _dequantised(a_q, a_scales, b_q, b_scales)
    exact, tol = _expected_and_bound(a, b, padded_offsets, row_offsets, out_n, case.swiglu,
                                     gpu)
    _check_output(out, exact, tol, row_offsets)
    # the plain-PyTorch reference keeps the same contract and the same bound
    ref = torch.full_like(out, float("nan"))
    mxfp8_grouped_mm_ref(a_q, a_scales, b_q, b_scales, *tables, ref, swiglu=case.swiglu,
                         block_m=case.block_m)
    _check_output(ref, exact, tol, row_offsets)


CASES = {
    # zero-row expert between two others; partial row blocks; K = 96 and N = 96 not
    # multiples of block_k = 64 / block_n = 32 * 2
    "mixed": Case(counts=(5, 0, 37, 16), k=96, n=96, block_n=64),
    # SwiGLU, F = 96 not a multiple of block_n = 64; a zero-row expert
    "swiglu": Case(counts=(17, 0, 9), k=64, n=192, swiglu=True, block_n=64),
    # every row to one expert (K = 1 of the layer), the others empty; no spare row (R equals
    # the live rows: the last, partial tile's masked rows lie beyond a_q and out)
    "one_expert": Case(counts=(0, 40, 0), k=64, n=64, spare_rows=0),
    # fewer rows than the row block
    "rows_below_block": Case(counts=(3,), k=32, n=32),
    # no live row at all: nothing written
    "no_rows": Case(counts=(0, 0), k=64, n=64),
    # prime E; expert 0 padded two tiles beyond minimal (programs walk several row tiles)
    "prime_e_over_padded": Case(counts=(7, 1, 20, 0, 33), k=128, n=64, extra_pad=2),
    # block_k = 32 (one dot per loop iteration); SwiGLU with F = block_n
    "swiglu_k32": Case(counts=(12, 25), k=96, n=64, swiglu=True, block_k=32),
    # extreme scales: odd rows tiny (scale byte 0: 2^-127, the fp32 subnormal scale; E4M3
    # subnormal values), weights huge (scale exponents near 100); the combined scale and the
    # results stay normal fp32
    "extreme_scales": Case(counts=(11, 20), k=64, n=64, a_exp=-133, b_exp=100),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_exact_mxfp8(name):
    _run_case(CASES[name])


def test_default_config():
    # config=None: ScaledGemmConfig.for_widths, block_m 128 (segments padded to 128)
    _run_case(Case(counts=(3, 130), k=64, n=64, block_m=128), config=None)


def test_default_config_picks_for_widths():
    # what config=None uses, for the default-config test above
    assert ScaledGemmConfig.for_widths(k=64, n=64) == ScaledGemmConfig(
        block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4)


def _integer_operands(rows, k, num_experts, n, device="cpu"):
    """E4M3 integers in [-6, 6] and scale exponents in [-2, 2]: every product is a multiple of
    2^-4, a 32-step partial at most 32 * 36 < 2^11 in magnitude, the whole sum at most
    (K/32) * 2^11 * 2^4 <= 2^21 units of 2^-4 < 2^24 units for K <= 128: every partial sum
    is exact in fp32 (and in the FP8 MMA's 13-bit accumulation), in any order."""
    def ints(*shape):
        v = torch.randint(-6, 7, shape, device=device)
        v = torch.where(v == 0, 1, v)  # never zero
        return v.float().to(torch.float8_e4m3fn)

    def scales(*shape):
        return torch.randint(125, 130, shape, device=device, dtype=torch.uint8)

    return (ints(rows, k), scales(rows, k // 32), ints(num_experts, n, k),
            scales(num_experts, n // 32, k // 32))


@pytest.mark.parametrize("swiglu", [False, True])
def test_exact_partials_bit_exact(swiglu):
    # every sum exact in fp32: the kernel must equal the reference bit for bit (SwiGLU: the
    # same fp32 g and u; the epilogue's sigmoid may differ in an fp32 ulp, rarely visible
    # after the bf16 rounding, so it gets the bound)
    counts, k, n = (9, 0, 21), 128, 128
    padded_offsets, row_offsets = _layout(counts, 16)
    rows = sum(counts) + 2
    operands = _integer_operands(rows, k, len(counts), n)
    out_n = n // 2 if swiglu else n
    out = torch.full((rows, out_n), float("nan"), dtype=torch.bfloat16)
    ref = torch.full_like(out, float("nan"))
    cfg = ScaledGemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    mxfp8_grouped_mm(*operands, padded_offsets, row_offsets, out, swiglu=swiglu, config=cfg)
    mxfp8_grouped_mm_ref(*operands, padded_offsets, row_offsets, ref, swiglu=swiglu,
                         block_m=16)
    live = int(row_offsets[-1])
    if not swiglu:
        assert torch.equal(out[:live], ref[:live])
    else:
        a, b = _dequantised(*operands)
        exact, tol = _expected_and_bound(a, b, padded_offsets, row_offsets, out_n, True, False)
        _check_output(out, exact, tol, row_offsets)
    assert out[live:].isnan().all()


def test_nan_propagates():
    # a NaN input makes its 32-block's qdata NaN (0x7F): its output row is NaN; a NaN scale
    # byte (0xFF) of a weight block makes that block's 32 output columns NaN for its expert
    counts, k, n = (6, 10), 64, 64
    padded_offsets, row_offsets = _layout(counts, 16)
    rows = sum(counts)
    a_q, a_scales, b_q, b_scales = _random_operands(rows, k, len(counts), n)
    a_q = a_q.clone()
    a_q.view(torch.uint8)[2, 40] = 0x7F
    b_scales = b_scales.clone()
    b_scales[1, 1, 0] = 0xFF
    cfg = ScaledGemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    mxfp8_grouped_mm(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, out, config=cfg)
    expected = torch.zeros(rows, n, dtype=torch.bool)
    expected[2] = True
    expected[6:, 32:] = True
    assert torch.equal(out.isnan(), expected)
    ref = torch.full_like(out, float("nan"))
    mxfp8_grouped_mm_ref(a_q, a_scales, b_q, b_scales, padded_offsets, row_offsets, ref,
                         block_m=16)
    assert torch.equal(ref.isnan(), expected)


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


def _good(k=64, n=64, rows=8, num_experts=2, swiglu=False):
    a_q, a_scales, b_q, b_scales = _integer_operands(rows, k, num_experts, n)
    padded_offsets, row_offsets = _layout((3, 5), 16)
    out = torch.empty(rows, n // 2 if swiglu else n, dtype=torch.bfloat16)
    return dict(a_q=a_q, a_scales=a_scales, b_q=b_q, b_scales=b_scales,
                padded_offsets=padded_offsets, row_offsets=row_offsets, out=out)


def _call(args, **kw):
    return mxfp8_grouped_mm(args["a_q"], args["a_scales"], args["b_q"], args["b_scales"],
                            args["padded_offsets"], args["row_offsets"], args["out"], **kw)


@pytest.mark.parametrize("change,error,match", [
    # activations in bf16, not quantised
    (lambda g: g.update(a_q=g["a_q"].bfloat16()), TypeError,
     r"a_q must have dtype float8_e4m3fn, got torch.bfloat16"),
    # K not a multiple of 32
    (lambda g: g.update(a_q=g["a_q"][:, :48].contiguous()), ValueError,
     r"K \(48\) must be a positive multiple of 32"),
    # scales as float32 instead of E8M0 bytes
    (lambda g: g.update(a_scales=g["a_scales"].float()), TypeError,
     r"a_scales must have dtype uint8"),
    # activation scales of the wrong width
    (lambda g: g.update(a_scales=g["a_scales"][:, :1].contiguous()), ValueError,
     r"a_scales must have shape \[8, 2\]"),
    # weights with another K
    (lambda g: g.update(b_q=g["b_q"][..., :32].contiguous()), ValueError,
     r"b_q must have K = 64"),
    # weight scales in the 1 x 32 row layout (MXFP8Weight.row_scales), not the block scales
    (lambda g: g.update(b_scales=g["b_scales"].repeat_interleave(32, dim=-2)), ValueError,
     r"b_scales must have shape \[2, 2, 2\].*forward orientation"),
    # weight rows not a multiple of 32
    (lambda g: g.update(b_q=g["b_q"][:, :48].contiguous()), ValueError,
     r"N \(48\) must be a positive multiple of 32"),
    # tables of the wrong dtype
    (lambda g: g.update(row_offsets=g["row_offsets"].long()), TypeError,
     r"row_offsets must have dtype int32"),
    # tables for another expert count
    (lambda g: g.update(padded_offsets=g["padded_offsets"][:2].contiguous()), ValueError,
     r"padded_offsets must have shape \[3\]"),
    # output of the wrong width
    (lambda g: g.update(out=g["out"][:, :32].contiguous()), ValueError,
     r"out must have shape \[8, 64\]"),
    # output in fp32
    (lambda g: g.update(out=g["out"].float()), TypeError, r"out must have dtype bfloat16"),
])
def test_refuses_bad_arguments(change, error, match):
    args = _good()
    change(args)
    with pytest.raises(error, match=match):
        _call(args)


def test_refuses_swiglu_arguments():
    # F = N / 2 = 48 is not a multiple of 32
    args = _good(n=96, swiglu=True)
    with pytest.raises(ValueError, match=r"N \(96, b_q.shape\[1\]\) must be 2F with F a "
                                         r"multiple of 32"):
        _call(args, swiglu=True)
    # with swiglu the output is [R, F]
    args = _good(n=128)
    with pytest.raises(ValueError, match=r"out must have shape \[8, 64\] \[R, F = N/2\]"):
        _call(args, swiglu=True)
    with pytest.raises(TypeError, match=r"swiglu must be a bool, got int"):
        _call(_good(), swiglu=1)
    # w13's 4-D layout needs its 4-D scales
    args = _good(n=128)
    args["b_q"] = args["b_q"].view(2, 2, 64, 64)
    args["out"] = torch.empty(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"b_scales must have shape \[2, 2, 2, 2\]"):
        _call(args, swiglu=True)


def test_swiglu_accepts_w13_layout():
    # b_q as w13's [E, 2, F, K] with scales [E, 2, F/32, K/32] equals the [E, 2F, K] view
    args = _good(n=128, swiglu=True)
    cfg = ScaledGemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    flat = _call(args, swiglu=True, config=cfg).clone()
    args["b_q"] = args["b_q"].view(2, 2, 64, 64)
    args["b_scales"] = args["b_scales"].view(2, 2, 2, 2)
    args["out"] = torch.full_like(flat, float("nan"))
    assert torch.equal(_call(args, swiglu=True, config=cfg)[:8], flat[:8])


def test_refuses_bad_config():
    with pytest.raises(TypeError, match=r"config must be a ScaledGemmConfig, got dict"):
        _call(_good(), config={"block_m": 16})
    with pytest.raises(ValueError, match=r"block_k \(16\) must be a power of two in \[32, 256\]"):
        ScaledGemmConfig(block_k=16)
    with pytest.raises(ValueError, match=r"block_n \(96\) must be a power of two in \[32, 256\]"):
        ScaledGemmConfig(block_n=96)
    with pytest.raises(ValueError, match=r"num_warps \(2\) must be 4 or 8"):
        ScaledGemmConfig(num_warps=2)
    for fp4_only in (dict(swap_ab=True), dict(interleave_k=False)):
        with pytest.raises(ValueError, match=r"are for the FP4-weight GEMMs"):
            _call(_good(), config=ScaledGemmConfig(block_m=16, **fp4_only))
    with pytest.raises(TypeError, match=r"interleave_k must be a bool, got int"):
        ScaledGemmConfig(interleave_k=1)


def test_configs_fit_hopper():
    # every sweep candidate and every default fits SM90 by the config's own model
    for swiglu in (False, True):
        cands = ScaledGemmConfig.all_configs(swiglu=swiglu)
        assert cands and all(c.fits_hopper(swiglu=swiglu) for c in cands)
        for k, n in ((2048, 1536), (4096, 4096), (32, 64), (7168, 4096)):
            assert ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu).fits_hopper(
                swiglu=swiglu)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def _gpu_case(swiglu):
    # R = 4096 rows over 8 experts (uneven, one empty), K = 2048, N = 1536 (2F with SwiGLU)
    counts = (700, 0, 512, 1, 1000, 383, 900, 600)
    return Case(counts=counts, k=2048, n=1536, swiglu=swiglu, spare_rows=64, block_m=128)


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_gpu_matches_exact_mxfp8(swiglu):
    _run_case(_gpu_case(swiglu), device="cuda", config=None, gpu=True)


@pytest.mark.gpu
def test_gpu_exact_partials_bit_exact():
    # integer operands (every partial sum exact, in the FP8 MMA too): bit for bit on the GPU
    counts, k, n = (700, 0, 512, 1, 1000, 383, 900, 600), 128, 1536
    padded_offsets, row_offsets = _layout(counts, 128)
    rows = sum(counts) + 64
    operands = _integer_operands(rows, k, len(counts), n, device="cuda")
    tables = (padded_offsets.cuda(), row_offsets.cuda())
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = torch.full_like(out, float("nan"))
    mxfp8_grouped_mm(*operands, *tables, out)
    mxfp8_grouped_mm_ref(*operands, *tables, ref, block_m=128)
    live = int(row_offsets[-1])
    assert torch.equal(out[:live], ref[:live])
    assert out[live:].isnan().all()
