"""mxfp8_quantize (Triton) against mxfp8_quantize_ref (float64 PyTorch), bit for bit, on fresh
mixed inputs of every input dtype; the rounding against torch's own E4M3 cast and against
RNE worked out by hand at every tie; the round-trip bound of docs/numerics.md; the edge cases
and the refusals."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from quant_cases import (
    BIG_TILE,
    DEVICE,
    DTYPES,
    POISON,
    SMALL_TILE,
    e4m3_values,
    midpoints,
    mixed_blocks,
    mxfp8_bound,
)

from distmoe.quant import (
    mxfp8_dequantize,
    mxfp8_quantize,
    mxfp8_quantize_ref,
)
from distmoe.quant.mxfp8 import mxfp8_quantize_2d

E4M3 = e4m3_values()


def _u8(t):
    return t.view(torch.uint8)


def _mixed(rows, cols, dtype, gen):
    return mixed_blocks(rows, cols, dtype, 32, gen, tie_grid=E4M3, tie_top=448.0)


def _check_bound(x, qdata, scales, dim=-1):
    """Every finite element within 2^(max(floor(log2|x|), e - 6) - 4) of its round trip."""
    x64 = x.to(torch.float64)
    back = mxfp8_dequantize(qdata, scales, dim).to(torch.float64)
    e = scales.to(torch.int64).repeat_interleave(32, dim=dim) - 127
    fin = torch.isfinite(x64)
    err = (x64 - back).abs()
    assert (err[fin] <= mxfp8_bound(x64, e)[fin]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 256), (1, 32), (70, 96)])
def test_kernel_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(shape[0] * 7 + dtype.itemsize)
    x = _mixed(*shape, dtype, gen)
    qdata = torch.full(shape, POISON, dtype=torch.uint8, device=DEVICE)  # missed store shows
    scales = torch.full((shape[0], shape[1] // 32), POISON, dtype=torch.uint8, device=DEVICE)
    mxfp8_quantize_2d(x, qdata, scales, config=BIG_TILE)
    want_q, want_s = mxfp8_quantize_ref(x)
    assert torch.equal(qdata, _u8(want_q)) and torch.equal(scales, want_s)
    _check_bound(x, want_q, want_s)


def test_small_tiles_match_reference():
    # several programs per axis, partial row tile (37 = 4 * 8 + 5) and group tile (5 groups)
    gen = torch.Generator().manual_seed(3)
    x = _mixed(37, 160, torch.bfloat16, gen)
    q, s = mxfp8_quantize(x, config=SMALL_TILE)
    want_q, want_s = mxfp8_quantize_ref(x)
    assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(s, want_s)


@pytest.mark.parametrize("dim", [0, 1, -3])
def test_other_dims(dim):
    # dim != -1: the blocks run along dim; same as quantising the moved tensor
    gen = torch.Generator().manual_seed(dim + 5)
    shape = [4, 5, 6]
    shape[dim] = 64
    x = torch.randn(shape, generator=gen).to(DEVICE) * 3
    q, s = mxfp8_quantize(x, dim, config=BIG_TILE)
    want_q, want_s = mxfp8_quantize_ref(x, dim)
    assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(s, want_s)
    assert q.shape == x.shape and s.shape[dim] == 2 and q.is_contiguous()
    moved_q, moved_s = mxfp8_quantize_ref(x.movedim(dim, -1))
    assert torch.equal(_u8(moved_q), _u8(want_q.movedim(dim, -1)))
    assert torch.equal(moved_s, want_s.movedim(dim, -1))
    _check_bound(x, q, s, dim)


def test_reference_agrees_with_torch_cast():
    # within range torch's float8 cast rounds to nearest even too: it must agree on x * 2^-e
    gen = torch.Generator().manual_seed(11)
    x = _mixed(64, 128, torch.float32, gen)
    q, s = mxfp8_quantize_ref(x)
    e = s.to(torch.float64).repeat_interleave(32, dim=-1) - 127
    cast = (x.to(torch.float64) * torch.exp2(-e)).to(torch.float32).to(torch.float8_e4m3fn)
    assert torch.equal(_u8(q), _u8(cast))


def test_ties_round_to_even():
    # every halfway point between two E4M3 values goes to the one with an even code
    mids = midpoints(E4M3)  # 126 ties, between codes c and c + 1
    want = torch.arange(126) + torch.arange(126) % 2  # the even one of c, c + 1
    blocks = torch.zeros(126 // 18 * 32, dtype=torch.float64)
    blocks = blocks.view(-1, 32)
    blocks[:, 0] = 448.0  # amax 448: e = 0, the ties stay ties
    blocks[:, 1:19] = mids.view(-1, 18)
    x = torch.cat([blocks, -blocks]).to(torch.float32).to(DEVICE)
    q, s = mxfp8_quantize(x, config=BIG_TILE)
    assert (s == 127).all()
    codes = _u8(q)[:, 1:19].reshape(2, -1).cpu().to(torch.int64)
    assert torch.equal(codes[0], want) and torch.equal(codes[1], want | 0x80)


def test_all_zero_block():
    # all-zero block: smallest scale (byte 0), zeros stored with their sign
    x = torch.zeros(2, 64, device=DEVICE)
    x[0, 3] = -0.0
    x[1, 32:] = 1.0
    q, s = mxfp8_quantize(x)
    assert s[0].tolist() == [0, 0] and s[1].tolist() == [0, 119]  # 1 <= 448 * 2^-8
    assert _u8(q)[0, 3] == 0x80 and (_u8(q)[0, 4:] == 0).all() and (_u8(q)[1, :32] == 0).all()


def test_outlier_underflows_small_value():
    # one outlier sets the shared scale: a small neighbour falls below 2^-10 * 2^e -> 0
    x = torch.full((1, 32), 0.001, device=DEVICE)
    x[0, 0] = 20000.0  # e = ceil(log2(20000 / 448)) = 6: 0.001 * 2^-6 < 2^-10
    q, s = mxfp8_quantize(x)
    back = mxfp8_dequantize(q, s)
    assert s.item() == 127 + 6 and back[0, 0] == 20480.0 and (back[0, 1:] == 0).all()
    alone = torch.full((1, 32), 0.001, device=DEVICE)  # without the outlier: kept
    assert (mxfp8_dequantize(*mxfp8_quantize(alone)) > 0).all()


def test_nan_and_inf():
    # NaN / +-Inf: stored as NaN with their sign, left out of the block's amax
    x = torch.randn(3, 32, device=DEVICE)
    bad = x.clone()
    bad[0, 5], bad[1, 6], bad[2, 7] = float("nan"), float("inf"), -float("inf")
    q, s = mxfp8_quantize(bad)
    want_q, want_s = mxfp8_quantize_ref(bad)
    assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(s, want_s)
    assert [_u8(q)[0, 5].item(), _u8(q)[1, 6].item(), _u8(q)[2, 7].item()] == [0x7F, 0x7F, 0xFF]
    clean = x.clone()
    clean[0, 5] = clean[1, 6] = clean[2, 7] = 0.0
    q0, s0 = mxfp8_quantize(clean)
    keep = torch.isfinite(bad)
    assert torch.equal(s, s0) and torch.equal(_u8(q)[keep], _u8(q0)[keep])
    assert torch.isnan(mxfp8_dequantize(q, s)[~keep]).all()


def test_no_saturation_under_ceil_rule():
    # saturation: the ceil rule keeps amax * 2^-e <= 448, so no finite value is clipped
    cases = [(448.0, 127, 448.0), (449.0, 128, 448.0), (480.0, 128, 480.0), (447.0, 127, 448.0),
             (512.0, 128, 512.0), (65504.0, 135, 65536.0)]  # (amax, scale byte, round trip)
    x = torch.zeros(len(cases), 32, device=DEVICE)
    x[:, 0] = torch.tensor([c[0] for c in cases])
    q, s = mxfp8_quantize(x)
    assert s[:, 0].tolist() == [c[1] for c in cases]
    assert mxfp8_dequantize(q, s)[:, 0].tolist() == [c[2] for c in cases]


def test_subnormals():
    # E4M3 subnormals (multiples of 2^-9 below 2^-6) kept, rounded to nearest even; float32
    # subnormal inputs in an all-tiny block scaled up by 2^127 exactly
    vals = [448.0, 2**-7, 3 * 2**-9, 2**-10, 1.5 * 2**-10, 2.5 * 2**-9, -(2**-9), 2**-11]
    want = [448.0, 2**-7, 3 * 2**-9, 0.0, 2**-9, 2 * 2**-9, -(2**-9), 0.0]
    x = torch.tensor([vals + [0.0] * 24], device=DEVICE)
    q, s = mxfp8_quantize(x)
    assert mxfp8_dequantize(q, s)[0, :8].tolist() == want
    tiny = [2.0**-130, 5 * 2.0**-136, -(2.0**-127), 2.0**-149]  # e = -127: times 2^127
    q, s = mxfp8_quantize(torch.tensor([tiny + [0.0] * 28], device=DEVICE))
    assert s.item() == 0 and _u8(q)[0, :4].tolist() == [0x20, 0x05, 0xB8, 0x00]
    assert mxfp8_dequantize(q, s)[0, :4].tolist() == tiny[:3] + [0.0]


def test_empty_and_batched():
    # zero rows: nothing launched; 3-D input: leading dims flattened into rows
    q, s = mxfp8_quantize(torch.empty(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and s.shape == (0, 2)
    x = torch.randn(2, 3, 64, device=DEVICE, dtype=torch.float16)
    q, s = mxfp8_quantize(x)
    want_q, want_s = mxfp8_quantize_ref(x)
    assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(s, want_s)


def test_dequantize_dtypes():
    # float32 result exact (checked in float64); bf16 / fp16 are its round to nearest even
    x = torch.randn(4, 64, device=DEVICE) * 100
    q, s = mxfp8_quantize(x)
    exact = q.to(torch.float64) * torch.exp2(s.to(torch.float64) - 127).repeat_interleave(32, -1)
    assert torch.equal(mxfp8_dequantize(q, s).to(torch.float64), exact)
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(mxfp8_dequantize(q, s, dtype=dt), exact.to(torch.float32).to(dt))
    nan_scale = s.clone()
    nan_scale[0, 0] = 0xFF  # a foreign NaN scale
    assert torch.isnan(mxfp8_dequantize(q, nan_scale)[0, :32]).all()


def test_refusals():
    # size not a multiple of 32, wrong dtypes, bad dim, wrong output buffers
    x = torch.randn(4, 48, device=DEVICE)
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(48\) must be a multiple of 32"):
        mxfp8_quantize(x)
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(48\) must be a multiple of 32"):
        mxfp8_quantize_ref(x)
    with pytest.raises(TypeError, match="x must have dtype bfloat16 or float16 or float32"):
        mxfp8_quantize(torch.zeros(4, 32, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"dim \(2\) must be in \[-2, 2\)"):
        mxfp8_quantize(torch.zeros(4, 32, device=DEVICE), 2)
    with pytest.raises(TypeError, match="dim must be an int"):
        mxfp8_quantize(torch.zeros(4, 32, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"scales must have shape \[4, 1\]"):
        mxfp8_quantize_2d(torch.zeros(4, 32, device=DEVICE),
                          torch.empty(4, 32, dtype=torch.uint8, device=DEVICE),
                          torch.empty(4, 2, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(TypeError, match="qdata must be a float8_e4m3fn"):
        mxfp8_dequantize(torch.zeros(4, 32, device=DEVICE), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scales must have shape \[4, 1\]"):
        mxfp8_dequantize(torch.zeros(4, 32, dtype=torch.uint8, device=DEVICE),
                         torch.zeros(1, 4, dtype=torch.uint8, device=DEVICE))


@settings(max_examples=50, deadline=None)
@given(hnp.arrays("float32",
                  st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
                  elements=st.floats(-(2.0**126), 2.0**126, width=32)))
def test_reference_round_trip_bound(arr):
    # |x - x^| <= 2^(max(floor(log2|x|), e - 6) - 4) for any finite float32 (below 2^126:
    # closer to float32's largest a round trip may overflow, docs/numerics.md)
    x = torch.from_numpy(arr.copy())
    q, s = mxfp8_quantize_ref(x)
    _check_bound(x, q, s)
