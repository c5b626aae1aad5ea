"""FP4-weight grouped GEMM on FP8 operands (distmoe.kernels.scaled.nvfp4.nvfp4_weight_fp8_mm)
against plain PyTorch.

The kernel expands each weight to ``w8 = RNE_e4m3(v * s_b * 2^(5 - e))`` (``e`` the exponent
of the largest block scale of the column in its 128-wide K group) and promotes each group's
FP8 dot with ``sa * 2^(e - 5)``. The reference computes the same ``w8`` in PyTorch, so against
the float64 product of the dequantised activations and those effective weights only the fp32
summation order differs: the bound of 128-wide K groups in docs/numerics.md, ``(127 + K/128 +
3) u S`` (plus the SM90 FP8 accumulation model on the GPU). A second check holds the kernel to
the exact NVFP4 weights within the weight expansion's own bound (2^-4 relative per weight,
plus the subnormal quantum). Outputs are poisoned with NaN: live rows must be written, others
left alone.
"""

from __future__ import annotations

import pytest
import torch
from test_nvfp4_weight_mm import (
    U32,
    Case,
    _check_output,
    _expected_and_bound,
    _layout,
    _operands,
)

from distmoe.kernels.scaled import ScaledGemmConfig
from distmoe.kernels.scaled.nvfp4 import (
    FP8_GROUP,
    fp4_weight_fp8_config,
    fp4_weight_fp8_values,
    nvfp4_weight_fp8_mm,
    nvfp4_weight_fp8_mm_ref,
    nvfp4_weight_values,
)
from distmoe.quant import fp8_block_quantize
from distmoe.quant.mxfp4 import mxfp4_quantize

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

#: SM90 FP8 MMA accumulation model (docs/numerics.md section 6): 13 fraction bits, truncated,
#: per 32-deep MMA, relative to the group's sum of magnitudes (a model checked on the GPU)
MMA_REL = 2.0**-13 * 33


def _fp8_bound_scale(k: int, gpu: bool) -> float:
    """Relative fp32 accumulation bound of a 128-group promotion chain (docs/numerics.md,
    128-wide K groups), in units of S = sum |a_k w_k|; the GPU adds the MMA model per step."""
    rel = (127 + k // FP8_GROUP + 3) * U32
    return rel + (MMA_REL * 4 if gpu else 0.0)


def _effective_operands(a_q, a_s, packed, scales, mx):
    a64 = a_q.double().cpu() * a_s.double().cpu().repeat_interleave(FP8_GROUP, dim=1)
    w = fp4_weight_fp8_values(packed.cpu(), scales.cpu(), mx=mx)
    return a64, w


def _run(case: Case, *, device="cpu", config=None, gpu=False, mx=False, row_scale=False):
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
    a_q, a_s = fp8_block_quantize(a)
    out_n = case.n // 2 if case.swiglu else case.n
    if config is None:
        config = ScaledGemmConfig(block_m=case.tile_m or case.block_m, block_n=case.block_n,
                                  block_k=128,
                                  num_warps=4, num_stages=2)
    tables = (padded_offsets.to(device), row_offsets.to(device))
    bp, bs = packed, scales
    if case.w13_view:
        bp = packed.view(num_experts, 2, out_n, case.k // 2)
        bs = scales.view(num_experts, 2, out_n, case.k // group)
    rs = None
    if row_scale:
        g = torch.Generator().manual_seed(rows)
        rs = (torch.exp2(torch.randint(-12, 12, (rows,), generator=g).float())
              * (1 + torch.rand(rows, generator=g))).to(device)
    out = torch.full((rows, out_n), float("nan"), dtype=torch.bfloat16, device=device)
    nvfp4_weight_fp8_mm(a_q, a_s, bp, bs, s_g, *tables, out, swiglu=case.swiglu, config=config,
                        a_row_scale=rs)

    a64, w = _effective_operands(a_q, a_s, packed, scales, mx)
    if rs is not None:
        a64 = a64 * rs.double().cpu()[:, None]
    sg64 = (torch.ones(num_experts, dtype=torch.float64) if mx else s_g.double().cpu())
    exact, tol = _expected_and_bound(a64, w, sg64, padded_offsets, row_offsets, out_n,
                                     case.swiglu, gpu, scale_roundings=1 if rs is None else 2,
                                     rel=_fp8_bound_scale(case.k, gpu))
    _check_output(out.cpu(), exact, tol, row_offsets)
    ref = torch.full_like(out, float("nan"))
    nvfp4_weight_fp8_mm_ref(a_q, a_s, bp, bs, s_g, *tables, ref, swiglu=case.swiglu,
                            block_m=case.block_m, a_row_scale=rs)
    _check_output(ref.cpu(), exact, tol, row_offsets)
    return out, (a_q, a_s), (packed, scales, s_g), tables


CASES = {
    # an empty expert between two others; partial row tiles; N = 48 a partial column tile;
    # K = 384: three K groups
    "partial_tiles": Case(counts=(5, 0, 19), k=384, n=48),
    # SwiGLU on w13's [E, 2, F, K/2] layout; F = 40 a partial column tile; empty experts
    "swiglu_w13": Case(counts=(0, 17, 3, 0), k=256, n=80, swiglu=True, w13_view=True),
    # segments padded beyond the minimum (the grid's row tiles walk further)
    "extra_padding": Case(counts=(7, 2), k=128, n=32, extra_pad=1),
    # no live row at all: nothing written
    "no_rows": Case(counts=(0, 0), k=128, n=32),
    # 16-row tiles inside segments padded to 64 (decode)
    "tiles_inside_padding": Case(counts=(3, 0, 70), k=128, n=32, block_m=64, tile_m=16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_float64_within_bound(name):
    _run(CASES[name])


def test_row_scale_and_mxfp4():
    _run(CASES["swiglu_w13"], row_scale=True)
    _run(CASES["partial_tiles"], mx=True)


def test_weight_expansion_bound():
    # the effective weights against NVFP4's exact ones: relative 2^-4 per value while the
    # expanded value is an E4M3 normal, else within half a subnormal step (2^-10 * 2^(e - 5));
    # all 127 non-NaN positive scale bytes, blocks mixed within a group
    torch.manual_seed(3)
    n, k = 64, 256
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = torch.randint(0, 127, (n, k // 16), dtype=torch.uint8)
    w = fp4_weight_fp8_values(packed, scales, mx=False)
    exact = nvfp4_weight_values(packed, scales).double()
    code = scales.to(torch.int32)
    e = torch.where(code >= 8, (code >> 3) - 7, -6).view(n, k // 128, 8).amax(-1)
    quantum = torch.ldexp(torch.ones(()), (e - 5 - 10).double()).repeat_interleave(128, -1)
    err = (w - exact).abs()
    assert (err <= 2.0**-4 * exact.abs() + quantum).all()
    assert (err > 0).any(), "no value rounded: the test data is too easy"
    # the largest value of each group stays below 448 after the shift
    assert (exact.abs() * torch.ldexp(torch.ones(()), -(e - 5).double())
            .repeat_interleave(128, -1) < 448).all()
    # MXFP4 values (2 significant bits) are exact unless 2^13 below the group's largest scale
    mx_scales = torch.randint(120, 134, (n, k // 32), dtype=torch.uint8)
    w_mx = fp4_weight_fp8_values(packed, mx_scales, mx=True)
    from distmoe.quant.mxfp4 import mxfp4_dequantize
    assert torch.equal(w_mx, mxfp4_dequantize(packed, mx_scales, dtype=torch.float64))


def test_single_products_bit_exact():
    # identity activations (scale 1, 1.0 is an E4M3 value) pick one weight per output: the
    # output is the effective weight times s_g, bit for bit, for every scale byte (NaN codes
    # give NaN columns)
    k, n = 128, 256
    packed = torch.randint(0, 256, (1, n, k // 2), dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.uint8).repeat(n * k // 16 // 256)
    scales = scales[torch.randperm(scales.numel())].view(1, n, k // 16)
    s_g = torch.tensor([2.0**-5])
    a_q = torch.cat([torch.eye(k), torch.zeros(2, k)]).to(torch.float8_e4m3fn)
    a_s = torch.ones(k + 2, 1)
    po, ro = _layout((k,), 16)
    out = torch.full((k + 2, n), float("nan"), dtype=torch.bfloat16)
    nvfp4_weight_fp8_mm(a_q, a_s, packed, scales.view(torch.float8_e4m3fn), s_g, po, ro, out,
                        config=ScaledGemmConfig(block_m=16, block_n=64, block_k=128,
                                                num_warps=4, num_stages=1))
    w = fp4_weight_fp8_values(packed, scales, mx=False)[0]  # [n, k]
    # a NaN weight makes its whole column NaN (0 x NaN in the other products): a matmul
    expect = ((torch.eye(k, dtype=torch.float64) @ w.T).float() * s_g).bfloat16()
    got = out[:k]
    same = (got.view(torch.int16) == expect.view(torch.int16)) | (got.isnan() & expect.isnan())
    assert same.all()
    assert got.isnan().any() and out[k:].isnan().all()


def test_argument_errors():
    E, n, k, R = 2, 32, 128, 8
    a_q = torch.zeros(R, k, dtype=torch.float8_e4m3fn)
    a_s = torch.ones(R, k // 128)
    packed = torch.zeros(E, n, k // 2, dtype=torch.uint8)
    scales = torch.zeros(E, n, k // 16, dtype=torch.float8_e4m3fn)
    gs = torch.ones(E)
    po, ro = _layout((4, 4), 16)
    out = torch.zeros(R, n, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="a must have dtype float8_e4m3fn"):
        nvfp4_weight_fp8_mm(a_q.bfloat16(), a_s, packed, scales, gs, po, ro, out)
    with pytest.raises(ValueError, match=r"a_scales must have shape \[8, 1\]"):
        nvfp4_weight_fp8_mm(a_q, torch.ones(R, 2), packed, scales, gs, po, ro, out)
    with pytest.raises(ValueError, match=r"K \(64, a.shape\[1\]\) must be a multiple of 128"):
        nvfp4_weight_fp8_mm(a_q[:, :64].contiguous(), a_s, packed[..., :32].contiguous(),
                            scales[..., :4].contiguous(), gs, po, ro, out)
    with pytest.raises(ValueError, match=r"config.block_k \(64\) must be 128"):
        nvfp4_weight_fp8_mm(a_q, a_s, packed, scales, gs, po, ro, out,
                            config=ScaledGemmConfig(block_m=16, block_k=64))


@pytest.mark.gpu
def test_gpu_moderate_shape():
    """One GPU: ~1000 rows over 8 experts (two empty), K = 512, N = 512 and SwiGLU F = 256 at
    the default configs, and GPT-OSS-like MXFP4 at K = 2048 (the bound with the FP8 MMA
    accumulation model)."""
    counts = (300, 0, 17, 129, 1, 0, 260, 255)
    for case in (Case(counts=counts, k=512, n=512, block_m=128),
                 Case(counts=counts, k=512, n=512, swiglu=True, w13_view=True, block_m=128)):
        cfg = fp4_weight_fp8_config(k=case.k, n=case.n, swiglu=case.swiglu, block_m=128)
        _run(case, device="cuda", config=cfg, gpu=True)
        _run(case, device="cuda", config=cfg, gpu=True, row_scale=True)
    case = Case(counts=(700, 0, 129, 300), k=2048, n=1024, block_m=128)
    _run(case, device="cuda", config=fp4_weight_fp8_config(k=2048, n=1024), gpu=True, mx=True)
