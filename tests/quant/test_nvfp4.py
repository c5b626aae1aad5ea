"""nvfp4_quantize (Triton) against nvfp4_quantize_ref (PyTorch), bit for bit, on fresh mixed
inputs of every input dtype, with the global scale per tensor or per row, computed or given;
the E2M1 rounding at every tie, the nibble order, the round-trip bound of docs/numerics.md,
the edge cases and the refusals."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from quant_cases import (
    BIG_TILE,
    DEVICE,
    DTYPES,
    E2M1,
    POISON,
    SMALL_TILE,
    midpoints,
    mixed_blocks,
    nvfp4_bound,
)

from distmoe.quant import nvfp4_dequantize, nvfp4_quantize, nvfp4_quantize_ref
from distmoe.quant.nvfp4 import nvfp4_quantize_2d, unpack_e2m1

TWO_M126 = 2.0**-126


def _u8(t):
    return t.view(torch.uint8)


def _same(got, want):
    return (torch.equal(got[0], want[0]) and torch.equal(_u8(got[1]), _u8(want[1]))
            and torch.equal(got[2], want[2]))


def _check_bound(x, packed, scales, s_g, dim=-1):
    """Every finite element of x within the bound of docs/numerics.md of its round trip."""
    x64 = x.to(torch.float64)
    back = nvfp4_dequantize(packed, scales, s_g, dim).to(torch.float64)
    decode = (scales.to(torch.float32) * s_g).to(torch.float64).repeat_interleave(16, dim)
    fin = torch.isfinite(x64) & torch.isfinite(decode)
    bound = nvfp4_bound(x64, decode, s_g.to(torch.float64).expand_as(x64))
    assert ((x64 - back).abs()[fin] <= bound[fin]).all()


def _mixed(rows, cols, dtype, gen):
    return mixed_blocks(rows, cols, dtype, 16, gen, tie_grid=E2M1, tie_top=6.0,
                        exp_range=(-6, 6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per", ["tensor", "row"])
@pytest.mark.parametrize("given_global", [False, True])
def test_kernel_matches_reference(dtype, per, given_global):
    gen = torch.Generator().manual_seed(dtype.itemsize * 4 + given_global * 2 + (per == "row"))
    rows, cols = 37, 256
    x = _mixed(rows, cols, dtype, gen)
    n_g = rows if per == "row" else 1
    # 2^-3: a "ties" block gets the block scale 2^k exactly, its halfway values stay ties
    s_g = torch.full((n_g,), 0.125 if given_global else float("nan"), device=DEVICE)
    packed = torch.full((rows, cols // 2), POISON, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((rows, cols // 16), POISON, dtype=torch.uint8, device=DEVICE)
    nvfp4_quantize_2d(x, packed, scales, s_g, per=per, given_global=given_global,
                      config=BIG_TILE)  # poisoned outputs: a missed store shows
    given = None
    if given_global:
        given = s_g.view(rows, 1) if per == "row" else s_g.view(())
    want = nvfp4_quantize_ref(x, global_scale=given, per=per)
    assert torch.equal(packed, want[0]) and torch.equal(scales, _u8(want[1]))
    assert torch.equal(s_g.view(want[2].shape), want[2])
    if not given_global:  # (a given global may saturate block scales: no bound)
        _check_bound(x, *want)
    got = nvfp4_quantize(x[:5, :48], global_scale=None, per=per)  # 3 blocks, a partial tile
    assert _same(got, nvfp4_quantize_ref(x[:5, :48], per=per))


@pytest.mark.parametrize("per", ["tensor", "row"])
def test_small_tiles_match_reference(per):
    # several programs per axis: partial row tile (37 = 4 * 8 + 5), partial group tile
    gen = torch.Generator().manual_seed(9 + (per == "row"))
    x = _mixed(37, 80, torch.bfloat16, gen)
    got = nvfp4_quantize(x, per=per, config=SMALL_TILE)
    assert _same(got, nvfp4_quantize_ref(x, per=per))


@pytest.mark.parametrize("dim", [0, 1])
def test_other_dims(dim):
    # dim != -1: blocks, packing and rows follow dim; per-row scales keep dim with size 1
    gen = torch.Generator().manual_seed(dim)
    shape = [3, 5, 7]
    shape[dim] = 32
    x = (torch.randn(shape, generator=gen) * 10).to(DEVICE)
    got = nvfp4_quantize(x, dim, per="row", config=BIG_TILE)
    want = nvfp4_quantize_ref(x, dim, per="row")
    assert _same(got, want)
    assert got[0].shape[dim] == 16 and got[1].shape[dim] == 2 and got[2].shape[dim] == 1
    moved = nvfp4_quantize_ref(x.movedim(dim, -1), per="row")
    assert torch.equal(moved[0], want[0].movedim(dim, -1))
    assert torch.equal(moved[2], want[2].movedim(dim, -1))
    _check_bound(x, *got, dim=dim)
    assert torch.equal(unpack_e2m1(got[0], dim).movedim(dim, -1),
                       unpack_e2m1(got[0].movedim(dim, -1)))


def test_ties_round_to_even():
    # each halfway point of the E2M1 grid goes to the neighbour with the even code
    mids = midpoints(E2M1)  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
    x = torch.zeros(2, 16, device=DEVICE)
    x[:, 0] = 6.0  # with s_g = 1: t = 1, s_b = 1, D = 1
    x[0, 1:8] = mids.to(torch.float32)
    x[1, 1:8] = -mids.to(torch.float32)
    packed, s_b, _ = nvfp4_quantize(x, global_scale=torch.tensor(1.0, device=DEVICE))
    nib = unpack_e2m1(packed)
    want = torch.tensor([0, 2, 2, 4, 4, 6, 6])  # codes: 0, 1, 1, 2, 2, 4, 4
    assert (_u8(s_b) == 0x38).all()
    assert torch.equal(nib[0, 1:8].cpu().long(), want)
    assert torch.equal(nib[1, 1:8].cpu().long(), want | 8)


def test_nibble_order():
    # element 2i in the low nibble, 2i + 1 in the high one; nibble = sign << 3 | code
    x = torch.zeros(1, 16, device=DEVICE)
    x[0, :4] = torch.tensor([0.5, 6.0, -1.0, 0.0])
    packed, _, _ = nvfp4_quantize(x, global_scale=torch.tensor(1.0, device=DEVICE))
    assert packed[0, :2].tolist() == [0x71, 0x0A]
    assert (packed[0, 2:] == 0).all()


def test_zero_blocks_and_tensor():
    # all-zero block: block scale 0, nibbles 0; all-zero tensor: global 2^-126
    x = torch.zeros(2, 32, device=DEVICE)
    x[1, 16:] = -0.0
    packed, s_b, s_g = nvfp4_quantize(x)
    assert s_g.item() == TWO_M126 and (_u8(s_b) == 0).all() and (packed == 0).all()
    _, _, s_row = nvfp4_quantize(x, per="row")
    assert (s_row == TWO_M126).all() and s_row.shape == (2, 1)


def test_outlier_underflows_small_values():
    # one outlier sets the tensor's global scale: a far smaller block gets block scale 0 and
    # dequantises to zero; per row, its own row keeps it; inside a block, 0.2 next to 6 -> 0
    x = torch.full((2, 16), 1e-3, device=DEVICE)
    x[0, 0] = 1e4
    packed, s_b, s_g = nvfp4_quantize(x)
    assert _u8(s_b)[1, 0] == 0 and (nvfp4_dequantize(packed, s_b, s_g)[1] == 0).all()
    packed, s_b, s_g = nvfp4_quantize(x, per="row")
    assert (nvfp4_dequantize(packed, s_b, s_g)[1] > 0).all()
    y = torch.zeros(1, 16, device=DEVICE)
    y[0, :2] = torch.tensor([6.0, 0.2])
    back = nvfp4_dequantize(*nvfp4_quantize(y, global_scale=torch.tensor(1.0, device=DEVICE)))
    assert back[0, :2].tolist() == [6.0, 0.0]


def test_nan_and_inf():
    # a block holding NaN / +-Inf: block scale NaN (0x7F), nibbles 0, all 16 values back as
    # NaN; amaxes skip them, so every other block is as without them
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 48, generator=gen).to(DEVICE)
    bad = x.clone()
    bad[0, 3], bad[1, 20], bad[2, 47] = float("nan"), float("inf"), -float("inf")
    for per in ("tensor", "row"):
        got = nvfp4_quantize(bad, per=per)
        assert _same(got, nvfp4_quantize_ref(bad, per=per))
        clean = nvfp4_quantize(torch.where(torch.isfinite(bad), bad, 0.0), per=per)
        hit = torch.zeros(3, 3, dtype=torch.bool, device=DEVICE)
        hit[0, 0] = hit[1, 1] = hit[2, 2] = True
        assert (_u8(got[1])[hit] == 0x7F).all()
        assert torch.equal(_u8(got[1])[~hit], _u8(clean[1])[~hit])
        assert torch.equal(got[2], clean[2])
        assert (got[0].view(3, 3, 8)[hit] == 0).all()
        back = nvfp4_dequantize(*got).view(3, 3, 16)
        assert torch.isnan(back[hit]).all() and not torch.isnan(back[~hit]).any()


def test_saturation():
    # block scale clamped at 448 (a too-small given global); an E2M1 value clamped at 6 when
    # the block scale rounds down (t = 1.0625, a tie, goes to 1.0: 6.375 / 1 -> 6)
    x = torch.zeros(2, 16, device=DEVICE)
    x[0, 0] = 1e6
    x[1, 0] = 6.375
    packed, s_b, _ = nvfp4_quantize(x, global_scale=torch.tensor(1.0, device=DEVICE))
    assert _u8(s_b)[:, 0].tolist() == [0x7E, 0x38]  # 448, 1.0
    assert unpack_e2m1(packed)[:, 0].tolist() == [7, 7]  # both 6
    want = nvfp4_quantize_ref(x, global_scale=torch.tensor(1.0, device=DEVICE))
    assert torch.equal(packed, want[0]) and torch.equal(_u8(s_b), _u8(want[1]))


def test_block_scale_division_order():
    # t = (bamax / 6) / s_g, two correctly rounded divisions in that order: here t lands on
    # an E4M3 tie (1.1875, 1.4375 -> even codes 1.25, 1.5); bamax / (6 * s_g) would fall
    # just below it and round down
    s_g = torch.tensor(0.1, device=DEVICE)
    x = torch.zeros(2, 16, device=DEVICE)
    x[:, 0] = torch.tensor([0.7124999761581421, 0.8624999523162842])
    _, s_b, _ = nvfp4_quantize(x, global_scale=s_g)
    assert _u8(s_b)[:, 0].tolist() == [0x3A, 0x3C]
    assert torch.equal(_u8(s_b), _u8(nvfp4_quantize_ref(x, global_scale=s_g)[1]))


def test_subnormal_block_scales():
    # block scales below 2^-6 are E4M3 subnormals (multiples of 2^-9), rounded to nearest even
    x = torch.zeros(3, 16, device=DEVICE)
    x[0, :2] = torch.tensor([6 * 2.0**-8, 3 * 2.0**-8])  # t = 2^-8: code 2, exact
    x[1, 0] = 6 * 3 * 2.0**-10  # t = 1.5 * 2^-9, a tie: code 2 (even)
    x[2, 0] = 6 * 2.0**-10  # t = 2^-10, a tie between 0 and 2^-9: 0, a zero block
    packed, s_b, s_g = nvfp4_quantize(x, global_scale=torch.tensor(1.0, device=DEVICE))
    assert _u8(s_b)[:, 0].tolist() == [2, 2, 0]
    back = nvfp4_dequantize(packed, s_b, s_g)
    assert back[0, :2].tolist() == [6 * 2.0**-8, 3 * 2.0**-8] and (back[2] == 0).all()
    want = nvfp4_quantize_ref(x, global_scale=torch.tensor(1.0, device=DEVICE))
    assert torch.equal(packed, want[0]) and torch.equal(_u8(s_b), _u8(want[1]))


def test_dequantize():
    # fl32(v * fl32(s_b * s_g)); bf16 / fp16 outputs are that float32 rounded to nearest even
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 64, generator=gen) * 30).to(DEVICE)
    packed, s_b, s_g = nvfp4_quantize(x, per="row")
    nib = unpack_e2m1(packed).long()
    v = E2M1.to(DEVICE)[nib & 7] * torch.where(nib >= 8, -1.0, 1.0).to(torch.float64)
    decode = (s_b.float() * s_g).repeat_interleave(16, -1)
    want = (v.float() * decode)
    assert torch.equal(nvfp4_dequantize(packed, s_b, s_g), want)
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(nvfp4_dequantize(packed, s_b, s_g, dtype=dt), want.to(dt))


def test_empty():
    # no rows: nothing launched, the global scale of no values is 2^-126
    packed, s_b, s_g = nvfp4_quantize(torch.empty(0, 32, device=DEVICE))
    assert packed.shape == (0, 16) and s_b.shape == (0, 2) and s_g.item() == TWO_M126


def test_refusals():
    # size not a multiple of 16, bad per, global_scale of the wrong shape / dtype, bad packed
    x = torch.randn(4, 24, device=DEVICE)
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(24\) must be a multiple of 16"):
        nvfp4_quantize(x)
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(24\) must be a multiple of 16"):
        nvfp4_quantize_ref(x)
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="per must be 'tensor' or 'row', got 'col'"):
        nvfp4_quantize(x, per="col")
    with pytest.raises(ValueError, match=r"global_scale must have shape \[4, 1\]"):
        nvfp4_quantize(x, global_scale=torch.ones(4, device=DEVICE), per="row")
    with pytest.raises(ValueError, match=r"global_scale must have shape \[\]"):
        nvfp4_quantize(x, global_scale=torch.ones(1, device=DEVICE))
    with pytest.raises(TypeError, match="global_scale must have dtype float32"):
        nvfp4_quantize(x, global_scale=torch.ones((), dtype=torch.float64, device=DEVICE))
    with pytest.raises(TypeError, match="x must have dtype"):
        nvfp4_quantize(x.to(torch.int32))
    with pytest.raises(ValueError, match=r"packed.shape\[1\] \(4\) must be a multiple of 8"):
        nvfp4_dequantize(torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 0),
                         torch.ones(()))
    with pytest.raises(ValueError, match="global_scale must be 0-d or have packed's 2 dims"):
        nvfp4_dequantize(torch.zeros(4, 8, dtype=torch.uint8),
                         torch.zeros(4, 1, dtype=torch.uint8), torch.ones(4))


@settings(max_examples=50, deadline=None)
@given(hnp.arrays("float32", st.tuples(st.integers(1, 3), st.sampled_from([16, 48])),
                  elements=st.floats(-(2.0**120), 2.0**120, width=32)),
       st.sampled_from(["tensor", "row"]))
def test_reference_round_trip_bound(arr, per):
    # |x - x^| <= (2^-2 + 2^-21) max(|x|, D) + 6 * 2^-10 * s_g * (1 + 2^-21) + 2^-146 for any
    # finite float32 (below 2^120: near float32's largest a round trip may overflow)
    x = torch.from_numpy(arr.copy())
    _check_bound(x, *nvfp4_quantize_ref(x, per=per))
