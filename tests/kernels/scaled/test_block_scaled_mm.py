"""128-wide K groups in the block-scaled grouped GEMM: DeepSeek-V3's block FP8
(:func:`fp8_block_grouped_mm`, float32 scales per 1 x 128 and 128 x 128 blocks) and MXFP8
rebased onto 128-wide groups (:func:`distmoe.quant.mxfp8_rebase`, then
``mxfp8_grouped_mm(k_group=128)``), with their quantisers.

Bounds (the kernel's arithmetic: one FP8 dot per 128-wide K step into a fresh fp32 partial,
promoted with both scales): every E4M3 product is exact in fp32; a step's partial passes
through at most 127 additions, its promotion through the scale product's rounding (float32
scales; exact for E8M0 powers of two), the multiply and the add, and K/128 - 1 additions
follow: ``(127 + K/128 + 3) * 2^-24 * sum |a_k b_k|`` (first order) against the float64
product of the dequantised operands. On the GPU the FP8 MMA chain of a step adds its own
accumulation error (13 fraction bits, truncated; the model of test_mxfp8_grouped_mm.py, per
32-deep MMA and summed over the four of a step). Then one bf16 rounding. Outputs are
poisoned with NaN first.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_mxfp8_grouped_mm import U16, U32, _check_output, _layout, _with_outliers

from distmoe.kernels.scaled import (
    ScaledGemmConfig,
    fp8_block_grouped_mm,
    fp8_block_grouped_mm_ref,
    mxfp8_grouped_mm,
    mxfp8_grouped_mm_ref,
)
from distmoe.quant import (
    fp8_block_dequantize,
    fp8_block_quantize,
    fp8_block_quantize_ref,
    fp8_block_quantize_weight,
    mxfp8_quantize,
    mxfp8_quantize_weight,
    mxfp8_rebase,
)
from distmoe.quant.mxfp8 import e8m0_to_float

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

TC = 2.0**-13  # Hopper FP8 MMA accumulation: fraction bits (test_mxfp8_grouped_mm.py)


def _operands(kind, rows, k, num_experts, n, device="cpu"):
    """Fresh random operands with outliers (one per 32-block: exponents differ between the
    four blocks of a group, so rebasing shifts values) and their float64 dequantised values
    ``(a [rows, K], b [E, N, K])``; for ``"rebased"`` also the number of values changed."""
    x = _with_outliers(torch.randn(rows, k, device=device), 2.0**10, (1, 32)).bfloat16()
    w = _with_outliers(torch.randn(num_experts, n, k, device=device) / math.sqrt(k), 2.0**6,
                       (32, 32)).bfloat16()
    if kind == "fp8_block":
        a_q, a_s = fp8_block_quantize(x)
        b_q, b_s = fp8_block_quantize_weight(w)
        a = fp8_block_dequantize(a_q, a_s, dtype=torch.float64)
        b = fp8_block_dequantize(b_q, b_s, dtype=torch.float64)
        return (a_q, a_s, b_q, b_s), a, b, 0
    a_q, a_s = mxfp8_quantize(x, dim=-1)
    w8 = mxfp8_quantize_weight(w)
    a_q, a_s, ca = mxfp8_rebase(a_q, a_s)
    b_q, b_s, cb = mxfp8_rebase(w8.qdata, w8.scales)
    a = a_q.double() * e8m0_to_float(a_s).double().repeat_interleave(128, -1)
    b = b_q.double() * e8m0_to_float(b_s).double().repeat_interleave(128, -1) \
        .repeat_interleave(32, -2)
    return (a_q, a_s, b_q, b_s), a, b, int(ca + cb)


def _step_max(x):
    return x.abs().unflatten(-1, (-1, 128)).amax(-1)


def _expected(a, b, counts, n, gpu):
    """float64 exact product per live row and the bound (module docstring)."""
    k = a.shape[1]
    exact = torch.zeros(sum(counts), n, dtype=torch.float64, device=a.device)
    tol = torch.zeros_like(exact)
    lo = 0
    for e, c in enumerate(counts):
        if c:
            ae, be = a[lo:lo + c], b[e]
            s_abs = ae.abs() @ be.abs().T
            err = 1.01 * (127 + k // 128 + 3) * U32 * s_abs
            if gpu:
                err = err + 128 * TC * (_step_max(ae) @ _step_max(be).T) + 4 * TC * s_abs
            exact[lo:lo + c] = ae @ be.T
            tol[lo:lo + c] = err + U16 * (exact[lo:lo + c].abs() + err) + 2.0**-133
        lo += c
    return exact, tol


def _run(kind, counts, k, n, *, block_m=16, config=None, device="cpu", spare=3):
    rows = sum(counts) + spare
    po, ro = _layout(counts, block_m)
    ops, a, b, _ = _operands(kind, rows, k, len(counts), n, device)
    tables = (po.to(device), ro.to(device))
    if config is None and device == "cpu":
        config = ScaledGemmConfig(block_m=block_m, block_n=32, block_k=128, num_warps=4,
                                  num_stages=2)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)
    ref = torch.full_like(out, float("nan"))
    if kind == "fp8_block":
        fp8_block_grouped_mm(*ops, *tables, out, config=config)
        fp8_block_grouped_mm_ref(*ops, *tables, ref, block_m=block_m)
    else:
        mxfp8_grouped_mm(*ops, *tables, out, config=config, k_group=128)
        mxfp8_grouped_mm_ref(*ops, *tables, ref, block_m=block_m, k_group=128)
    exact, tol = _expected(a, b, counts, n, device != "cpu")
    _check_output(out, exact, tol, ro)
    _check_output(ref, exact, tol, ro)


@pytest.mark.parametrize("kind", ["fp8_block", "rebased"])
@pytest.mark.parametrize("counts,k,n", [
    ((5, 0, 37, 16), 256, 128),  # an empty expert; K two groups; partial row tiles
    ((0, 40), 384, 256),  # three groups; a tile per 128 weight rows
])
def test_matches_exact_product(kind, counts, k, n):
    _run(kind, counts, k, n)


def test_swiglu_fp8_block():
    # SwiGLU on w13's [E, 2, F, K] layout with [E, 2, F/128, K/128] scales: the same bits as
    # the [E, 2F, K] view
    counts, k, f = (9, 20), 128, 128
    po, ro = _layout(counts, 16)
    ops, _, _, _ = _operands("fp8_block", sum(counts), k, 2, 2 * f)
    cfg = ScaledGemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=2)
    flat = torch.full((sum(counts), f), float("nan"), dtype=torch.bfloat16)
    fp8_block_grouped_mm(*ops, po, ro, flat, swiglu=True, config=cfg)
    a_q, a_s, b_q, b_s = ops
    four = torch.full_like(flat, float("nan"))
    fp8_block_grouped_mm(a_q, a_s, b_q.view(2, 2, f, k), b_s.view(2, 2, 1, 1), po, ro, four,
                         swiglu=True, config=cfg)
    assert torch.equal(flat, four)
    ref = torch.full_like(flat, float("nan"))
    fp8_block_grouped_mm_ref(*ops, po, ro, ref, swiglu=True, block_m=16)
    assert ((flat.float() - ref.float()).abs() <= 2 * U16 * ref.float().abs() + 1e-3).all()


# ---------------------------------------------------------------------------- quantisers
def _quant_input(dtype, device="cpu"):
    """Magnitudes over 16 decades (E4M3 subnormals after scaling), an all-zero block, NaN,
    -Inf and -0.0."""
    x = torch.randn(37, 384) * torch.logspace(-8, 8, 384)
    x[0, :128] = 0.0
    x[1, 3] = float("nan")
    x[2, 200] = float("-inf")
    x[3, 7] = -0.0
    return x.to(dtype).to(device)


def _assert_same_quant(x):
    q, s = fp8_block_quantize(x)
    q_ref, s_ref = fp8_block_quantize_ref(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_block_kernel_gives_reference_bits(dtype):
    _assert_same_quant(_quant_input(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fp8_block_kernel_gives_reference_bits(dtype):
    _assert_same_quant(_quant_input(dtype, "cuda"))


def test_fp8_block_quantize_rule():
    x = torch.randn(3, 384) * torch.logspace(-4, 4, 384)
    x[0, :128] = 0.0  # an all-zero block: scale 1, zeros
    x[1, 5] = float("nan")
    x[2, 300] = float("-inf")
    q, s = fp8_block_quantize(x)
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), 0.0).unflatten(-1, (3, 128)).amax(-1)
    assert torch.equal(s, torch.where(amax > 0, amax / 448.0, 1.0))
    assert torch.equal(q[0, :128].float(), torch.zeros(128))
    nan_bits = q.view(torch.uint8)[~finite]
    assert torch.equal(nan_bits & 0x7F, torch.full_like(nan_bits, 0x7F))
    assert int(q.view(torch.uint8)[2, 300]) == 0xFF  # NaN with the input's sign
    # every finite value within half an E4M3 step at its binade of x / s (2^-10 s below the
    # normal range), plus the scale's rounding
    y = fp8_block_dequantize(q, s, dtype=torch.float64)
    xs = x.double() / s.double().repeat_interleave(128, -1)
    step = torch.exp2(torch.floor(torch.log2(xs.abs().clamp(min=2.0**-6))) - 3)
    bound = (step / 2) * s.double().repeat_interleave(128, -1) + 2 * U32 * x.double().abs()
    assert ((y - x.double()).abs() <= bound)[finite].all()


def test_fp8_block_scale_underflow():
    # a block whose amax / 448 underflows float32 (found by hypothesis): scale 1, zeros, in
    # the kernel and the reference alike (before the fix: 0 / 0 gave NaN in one, 448 in the
    # other)
    x = torch.full((1, 128), 2.0**-149)
    x[0, 0] = 0.0
    q, s = fp8_block_quantize(x)
    q_ref, s_ref = fp8_block_quantize_ref(x)
    assert torch.equal(s, torch.ones(1, 1)) and torch.equal(s_ref, s)
    assert torch.equal(q.view(torch.uint8), torch.zeros(1, 128, dtype=torch.uint8))
    assert torch.equal(q_ref.view(torch.uint8), q.view(torch.uint8))


def test_fp8_block_weight_blocks():
    # one outlier in block (1, 2) of a [256, 384] weight changes only that block's scale
    w = torch.randn(2, 256, 384)
    _, s = fp8_block_quantize_weight(w)
    w2 = w.clone()
    w2[1, 200, 300] = 1e4
    q2, s2 = fp8_block_quantize_weight(w2)
    diff = (s2 != s).nonzero().tolist()
    assert diff == [[1, 1, 2]]
    assert s2[1, 1, 2] == torch.tensor(1e4) / 448.0
    assert float(fp8_block_dequantize(q2, s2)[1, 200, 300]) == pytest.approx(1e4, rel=2**-4)


def test_rebase_is_exact_but_for_counted_subnormals():
    x = _with_outliers(torch.randn(64, 512), 2.0**10, (1, 32)).bfloat16()
    q, s = mxfp8_quantize(x, dim=-1)
    q2, s2, changed = mxfp8_rebase(q, s)
    before = q.double() * e8m0_to_float(s).double().repeat_interleave(32, -1)
    after = q2.double() * e8m0_to_float(s2).double().repeat_interleave(128, -1)
    moved = before != after
    assert int(changed) == int(moved.sum()) > 0  # outliers make some values round
    # each changed value errs by at most half a subnormal step at its group's scale
    half_step = 2.0**-10 * e8m0_to_float(s2).double().repeat_interleave(128, -1)
    assert ((after - before).abs() <= half_step).all()
    assert torch.equal(s2, s.unflatten(-1, (4, 4)).amax(-1))
    # weights: 32 x 32 block scales rebase along K per 32-row block
    w8 = mxfp8_quantize_weight(torch.randn(2, 64, 256).bfloat16())
    wq, ws, _ = mxfp8_rebase(w8.qdata, w8.scales)
    assert ws.shape == (2, 2, 2) and wq.shape == w8.qdata.shape


def test_refusals():
    ops, _, _, _ = _operands("fp8_block", 8, 128, 2, 128)
    po, ro = _layout((3, 5), 16)
    out = torch.empty(8, 128, dtype=torch.bfloat16)
    a_q, a_s, b_q, b_s = ops
    with pytest.raises(TypeError, match=r"a_scales must have dtype float32"):
        fp8_block_grouped_mm(a_q, a_s.to(torch.uint8), b_q, b_s, po, ro, out)
    with pytest.raises(ValueError, match=r"b_scales must have shape \[2, 1, 1\]"):
        fp8_block_grouped_mm(a_q, a_s, b_q, b_s.repeat_interleave(2, -1), po, ro, out)
    with pytest.raises(ValueError, match=r"K \(96\) must be a positive multiple of 128"):
        fp8_block_grouped_mm(a_q[:, :96].contiguous(), a_s, b_q, b_s, po, ro, out)
    with pytest.raises(ValueError, match=r"k_group \(64\) must be 32 .* or 128"):
        mxfp8_grouped_mm(a_q, a_s, b_q, b_s, po, ro, out, k_group=64)
    with pytest.raises(ValueError, match=r"config.block_k \(64\) must be at least the K group"):
        fp8_block_grouped_mm(a_q, a_s, b_q, b_s, po, ro, out,
                             config=ScaledGemmConfig(block_m=16, block_k=64))
    with pytest.raises(ValueError, match=r"K \(96\) must be a positive multiple of 128"):
        fp8_block_quantize(torch.randn(2, 96))
    with pytest.raises(ValueError, match=r"N \(64\) must be a positive multiple of 128"):
        fp8_block_quantize_weight(torch.randn(64, 128))
    q, s = mxfp8_quantize(torch.randn(4, 96).bfloat16(), dim=-1)
    with pytest.raises(ValueError, match=r"K \(96, qdata.shape\[-1\]\) must be a positive "
                                         r"multiple of group \(128\)"):
        mxfp8_rebase(q, s)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8_block", "rebased"])
def test_gpu_matches_exact_product(kind):
    counts = (700, 0, 512, 1, 1000, 383, 900, 600)
    _run(kind, counts, 2048, 1536, block_m=128, device="cuda", spare=64)


def _assert_rebased_quantiser_bits(device):
    from distmoe.quant.formats import QuantLaunchConfig
    from distmoe.quant.mxfp8 import mxfp8_quantize_rebased_2d
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(37, 512) * torch.logspace(-6, 6, 512)).to(dtype)
        x[0, :40] = 0.0
        x[1, 5] = float("nan")
        x[2, 300] = float("inf")
        x = x.to(device)
        want_q, want_s, _ = mxfp8_rebase(*mxfp8_quantize(x, dim=-1))
        for cfg in (None, QuantLaunchConfig(block_rows=8, block_groups=8)):
            q = torch.empty(37, 512, dtype=torch.float8_e4m3fn, device=device)
            s = torch.empty(37, 4, dtype=torch.uint8, device=device)
            mxfp8_quantize_rebased_2d(x, q, s, config=cfg)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(s, want_s)


def test_rebased_quantiser_gives_quantise_then_rebase_bits():
    # one kernel: quantise per 32 then rebase per 128, the bits of the two-step path
    _assert_rebased_quantiser_bits("cpu")


@pytest.mark.gpu
def test_gpu_rebased_quantiser_bits():
    _assert_rebased_quantiser_bits("cuda")


# ---------------------------------------------------------------------------- Gluon kernel
def _gluon_config(swiglu, stages=5):
    return ScaledGemmConfig(block_m=128, block_n=64 if swiglu else 128, block_k=128,
                            num_warps=8, num_stages=stages, gluon=True)


def test_gluon_reasons():
    # where the warp-specialised kernel cannot run, a sentence says why (on CPU: the device)
    from distmoe.kernels.scaled.gluon import gluon_scaled_reason, shape_reason
    ok = dict(k=2048, n=1536, swiglu=False, k_group=128, block_m=128, block_n=128,
              block_k=128, stages=5, warps=8)
    assert shape_reason(**ok) is None
    assert shape_reason(**(ok | dict(swiglu=True, block_n=64))) is None
    assert "k_group 32" in shape_reason(**(ok | dict(k_group=32)))
    assert "block_n must be 64 with SwiGLU" in shape_reason(**(ok | dict(swiglu=True)))
    assert "K (2112) must be a multiple of 128" in shape_reason(**(ok | dict(k=2112)))
    assert "stages must be one of" in shape_reason(**(ok | dict(stages=7)))
    assert "(128, 128, 64, 8)" in shape_reason(**(ok | dict(block_k=64)))
    assert gluon_scaled_reason(torch.device("cpu"), **ok) is not None


def test_gluon_config_falls_back_with_a_warning():
    # on CPU the Gluon config runs the Triton kernel and says why
    counts, k, n = (5, 11), 128, 128
    po, ro = _layout(counts, 128)
    ops, a, b, _ = _operands("fp8_block", sum(counts), k, 2, n)
    out = torch.full((sum(counts), n), float("nan"), dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="Gluon kernel cannot run this call"):
        fp8_block_grouped_mm(*ops, po, ro, out, config=_gluon_config(False, 3))
    exact, tol = _expected(a, b, counts, n, False)
    _check_output(out, exact, tol, ro)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [4, 6])
@pytest.mark.parametrize("kind", ["fp8_block", "rebased"])
def test_gpu_gluon_matches_exact_product(kind, stages):
    counts = (700, 0, 512, 1, 1000, 383, 900, 600)
    _run(kind, counts, 2048, 1536, block_m=128, device="cuda", spare=64,
         config=_gluon_config(False, stages))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8_block", "rebased"])
def test_gpu_gluon_swiglu(kind):
    # h = silu(g) * u against the exact g and u: |dh| <= 1.1 |u| tol_g + |silu(g)| tol_u +
    # tol_g tol_u, then the bf16 rounding of h (and fp32 slack in the SwiGLU)
    counts, k, f = (300, 129, 0, 1024, 77), 1024, 768
    rows = sum(counts) + 40
    po, ro = _layout(counts, 128)
    ops, a, b, _ = _operands(kind, rows, k, len(counts), 2 * f, "cuda")
    out = torch.full((rows, f), float("nan"), dtype=torch.bfloat16, device="cuda")
    tables = (po.cuda(), ro.cuda())
    if kind == "fp8_block":
        fp8_block_grouped_mm(*ops, *tables, out, swiglu=True, config=_gluon_config(True))
    else:
        mxfp8_grouped_mm(*ops, *tables, out, swiglu=True, config=_gluon_config(True),
                         k_group=128)
    exact, tol = _expected(a, b, counts, 2 * f, True)
    g, u, tg, tu = exact[:, :f], exact[:, f:], tol[:, :f], tol[:, f:]
    h = torch.nn.functional.silu(g) * u
    bound = 1.1 * u.abs() * tg + torch.nn.functional.silu(g).abs() * tu + tg * tu
    bound = bound + U16 * (h.abs() + bound) + 8 * U32 * h.abs() + 2.0**-133
    live = out[:int(ro[-1])].double()
    assert not torch.isnan(live).any()
    err = (live - h).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert torch.isnan(out[int(ro[-1]):].float()).all()  # rows past the live ones untouched


def _scatter_case(kind, counts, k, n, device, config):
    """The GEMM into ``out``, and again into rows at addresses (``scatter_ptrs``: a shuffled
    destination row per live padded row, 0 for every third): the stored rows must be the
    ``out`` rows bit for bit, and nothing else written."""
    po, ro = _layout(counts, 128 if device == "cuda" else 16)
    rows = sum(counts) + 5
    ops, _, _, _ = _operands(kind, rows, k, len(counts), n, device)
    tables = (po.to(device), ro.to(device))
    run = fp8_block_grouped_mm if kind == "fp8_block" else \
        (lambda *a, **kw: mxfp8_grouped_mm(*a, **kw, k_group=128))
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)
    run(*ops, *tables, out, config=config)
    r_cap = int(po[-1])
    dest = torch.full((r_cap + 3, n), float("nan"), dtype=torch.bfloat16, device=device)
    perm = torch.randperm(r_cap + 3)[:r_cap]
    ptrs = dest.data_ptr() + perm.to(torch.int64) * (n * 2)
    ptrs[::3] = 0
    act = torch.full((r_cap,), -1, dtype=torch.int64)  # activation row of each padded row
    for e in range(len(counts)):
        c = int(ro[e + 1] - ro[e])
        act[int(po[e]):int(po[e]) + c] = torch.arange(int(ro[e]), int(ro[e]) + c)
    run(*ops, *tables, None, config=config, scatter_ptrs=ptrs.to(device))
    stored = (act >= 0) & (ptrs != 0)
    want = torch.full_like(dest, float("nan"))
    want[perm[stored]] = out[act[stored].to(device)]
    assert torch.equal(dest.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("kind", ["fp8_block", "rebased"])
def test_scatter_rows_are_out_rows(kind):
    _scatter_case(kind, (5, 0, 21), 128, 128, "cpu",
                  ScaledGemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4,
                                   num_stages=2))


def test_scatter_refusals():
    ops, _, _, _ = _operands("fp8_block", 8, 128, 2, 128)
    po, ro = _layout((3, 5), 16)
    out = torch.empty(8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be None when scatter_ptrs is given"):
        fp8_block_grouped_mm(*ops, po, ro, out, scatter_ptrs=torch.zeros(32, dtype=torch.int64))
    with pytest.raises(TypeError, match="scatter_ptrs must have dtype int64"):
        fp8_block_grouped_mm(*ops, po, ro, None, scatter_ptrs=torch.zeros(32))


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("kind", ["fp8_block", "rebased"])
def test_gpu_scatter_rows_are_out_rows(kind, gluon):
    cfg = _gluon_config(False) if gluon else None
    _scatter_case(kind, (700, 0, 129, 1000), 1024, 2048, "cuda", cfg)
