"""Block-FP8 quantisers and the MXFP8 rebase (distmoe.quant.fp8_block), property-based
(hypothesis): the Triton activation quantisers (block FP8, MXFP8 and rebased MXFP8, on the GPU
when there is one: its hardware E4M3 conversion) give the plain-PyTorch references' bits on
any finite or non-finite float32 input, subnormals included, the round trip stays within the format's bound, and
rebasing moves only values below E4M3's subnormal step at the group's scale, each by at most
half that step. (The kernels' fixed cases: tests/kernels/scaled/test_block_scaled_mm.py.)"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distmoe.quant import (
    fp8_block_dequantize,
    fp8_block_quantize,
    fp8_block_quantize_ref,
    mxfp8_quantize_ref,
    mxfp8_rebase,
)
from distmoe.quant.mxfp8 import (
    e8m0_to_float,
    mxfp8_quantize,
    mxfp8_quantize_rebased_2d,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ROWS = st.tuples(st.integers(1, 3), st.sampled_from([128, 256]))


ANY_FLOAT32 = hnp.arrays("float32", ROWS, elements=st.floats(width=32, allow_nan=True,
                                                               allow_infinity=True))


def _same_bits(got, want):
    return torch.equal(got.cpu().view(torch.uint8), want.reshape(got.shape).view(torch.uint8))


@settings(max_examples=30, deadline=None)
@given(ANY_FLOAT32)
def test_kernels_give_reference_bits(arr):
    x = torch.from_numpy(arr.copy())
    xd = x.to(DEVICE)
    q, s = fp8_block_quantize(xd)
    q_ref, s_ref = fp8_block_quantize_ref(x)
    assert _same_bits(q, q_ref) and _same_bits(s, s_ref)
    q, s = mxfp8_quantize(xd)
    q_ref, s_ref = mxfp8_quantize_ref(x)
    assert _same_bits(q, q_ref) and _same_bits(s, s_ref)
    qr = torch.empty_like(q)
    sr = torch.empty(x.shape[0], x.shape[1] // 128, dtype=torch.uint8, device=DEVICE)
    mxfp8_quantize_rebased_2d(xd, qr, sr)
    qr_ref, sr_ref, _ = mxfp8_rebase(q_ref, s_ref)
    assert _same_bits(qr, qr_ref) and _same_bits(sr, sr_ref)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays("float32", ROWS, elements=st.floats(-(2.0**120), 2.0**120, width=32)))
def test_round_trip_bound(arr):
    # |x - q s| <= half an E4M3 step at the binade of x / s (2^-10 s below E4M3's normal
    # range), widened by the scale's and the division's roundings (2^-20 relative)
    x = torch.from_numpy(arr.copy())
    q, s = fp8_block_quantize_ref(x)
    y = fp8_block_dequantize(q, s, dtype=torch.float64)
    s64 = s.double().repeat_interleave(128, -1)
    t = (x.double() / s64).abs()
    step = torch.exp2(torch.floor(torch.log2(t.clamp(min=2.0**-6))) - 3)
    bound = step / 2 * s64 * (1 + 2.0**-20) + 2.0**-20 * x.double().abs()
    assert ((y - x.double()).abs() <= bound).all()


@settings(max_examples=40, deadline=None)
@given(hnp.arrays("float32", st.tuples(st.integers(1, 3), st.sampled_from([128, 256])),
                  elements=st.floats(-(2.0**60), 2.0**60, width=32)))
def test_rebase_moves_only_sub_subnormal_values(arr):
    x = torch.from_numpy(arr.copy())
    q, s = mxfp8_quantize_ref(x)
    q2, s2, changed = mxfp8_rebase(q, s)
    before = q.double() * e8m0_to_float(s).double().repeat_interleave(32, -1)
    after = q2.double() * e8m0_to_float(s2).double().repeat_interleave(128, -1)
    group_scale = e8m0_to_float(s2).double().repeat_interleave(128, -1)
    moved = before != after
    assert int(changed) == int(moved.sum())
    assert ((after - before).abs() <= 2.0**-10 * group_scale).all()
    # a moved value lies below E4M3's normal range at the group's scale
    assert (before.abs()[moved] < 2.0**-6 * group_scale[moved]).all()
