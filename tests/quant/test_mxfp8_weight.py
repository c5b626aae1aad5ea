"""mxfp8_quantize_weight (Triton, 32 x 32 blocks) against its float64 reference, bit for bit;
one qdata serving the row-wise and the column-wise reader (the scale forms agree with the block
scales and with dequantising along either axis); the round-trip bound; edge cases; refusals."""

import pytest
import torch
from quant_cases import BIG_TILE, DEVICE, DTYPES, POISON, SMALL_TILE, e4m3_values, mixed_blocks

from distmoe.quant import (
    MXFP8Weight,
    mxfp8_dequantize,
    mxfp8_quantize_weight,
    mxfp8_quantize_weight_ref,
)
from distmoe.quant.mxfp8_weight import mxfp8_quantize_weight_2d


def _u8(t):
    return t.view(torch.uint8)


def _weight(shape, dtype, gen):
    """Mixed 32-wide blocks, then rows grouped by 32 share a magnitude (so the 32 x 32 tile's
    amax comes from varied rows)."""
    *lead, n, k = shape
    rows = mixed_blocks(int(torch.tensor(lead).prod()) * n if lead else n, k, dtype, 32, gen,
                        tie_grid=e4m3_values(), tie_top=448.0)
    return rows.view(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 96), (2, 32, 160)])
def test_kernel_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1] + dtype.itemsize)
    w = _weight(shape, dtype, gen)
    n, k = shape[-2:]
    qdata = torch.full((w.numel() // k, k), POISON, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((w.numel() // k // 32, k // 32), POISON, dtype=torch.uint8,
                        device=DEVICE)  # missed stores show
    mxfp8_quantize_weight_2d(w.reshape(-1, k), qdata, scales, config=BIG_TILE)
    want = mxfp8_quantize_weight_ref(w)
    assert torch.equal(qdata.view(shape), _u8(want.qdata))
    assert torch.equal(scales.view(want.scales.shape), want.scales)
    got = mxfp8_quantize_weight(w, config=SMALL_TILE)  # several group tiles, partial last
    assert torch.equal(_u8(got.qdata), _u8(want.qdata)) and torch.equal(got.scales, want.scales)


def test_one_qdata_both_orientations():
    # row_scales / col_scales repeat the block scale; dequantising along K (row reader) and
    # along N (column reader) gives the same weight, and the transposed views line up
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 64, 96, generator=gen) * torch.rand(3, 64, 96, generator=gen) * 50)
    wq = mxfp8_quantize_weight(w.to(DEVICE))
    assert wq.scales.shape == (3, 2, 3)
    assert wq.row_scales.shape == (3, 64, 3) and wq.col_scales.shape == (3, 2, 96)
    n, k = torch.meshgrid(torch.arange(64), torch.arange(96), indexing="ij")
    block = wq.scales[:, n // 32, k // 32]
    assert torch.equal(wq.row_scales[:, n, k // 32], block)
    assert torch.equal(wq.col_scales[:, n // 32, k], block)
    by_rows = mxfp8_dequantize(wq.qdata, wq.row_scales, dim=-1)
    by_cols = mxfp8_dequantize(wq.qdata, wq.col_scales, dim=-2)
    assert torch.equal(by_rows, by_cols)
    by_t = mxfp8_dequantize(wq.qdata.mT, wq.col_scales.mT, dim=-1)  # the dgrad operand w.T
    assert torch.equal(by_t, by_rows.mT)
    e = wq.scales.to(torch.int64).repeat_interleave(32, -2).repeat_interleave(32, -1) - 127
    err = (w.to(torch.float64) - by_rows.to(torch.float64).cpu()).abs()
    fl = torch.frexp(w.to(torch.float64).abs())[1].to(torch.int64) - 1
    assert (err <= torch.exp2(torch.maximum(fl, e.cpu() - 6).to(torch.float64) - 4)).all()


def test_tile_amax_sets_every_row():
    # one outlier in a tile raises the scale of all 32 rows and 32 columns of that tile only
    w = torch.ones(64, 64, device=DEVICE)
    w[5, 40] = 1000.0
    wq = mxfp8_quantize_weight(w)
    assert wq.scales.tolist() == [[119, 129], [119, 119]]  # 1 -> e = -8; 1000 -> e = 2


def test_edge_blocks():
    # all-zero tile -> byte 0; NaN / Inf -> NaN, out of the amax; fp16 subnormals kept
    w = torch.zeros(32, 96, dtype=torch.float16, device=DEVICE)
    w[0, 32], w[1, 33], w[2, 34] = float("nan"), float("-inf"), 2.0
    w[0, 64], w[1, 65] = 2.0**-24, -3 * 2.0**-24
    wq = mxfp8_quantize_weight(w)
    want = mxfp8_quantize_weight_ref(w)
    assert torch.equal(_u8(wq.qdata), _u8(want.qdata)) and torch.equal(wq.scales, want.scales)
    assert wq.scales.tolist() == [[0, 120, 96]]  # amax 2 -> e = -7; 3 * 2^-24 -> e = -31
    assert _u8(wq.qdata)[0, 32] == 0x7F and _u8(wq.qdata)[1, 33] == 0xFF
    back = mxfp8_dequantize(wq.qdata, wq.row_scales)
    assert back[0, 64] == 2.0**-24 and back[1, 65] == -3 * 2.0**-24


def test_refusals():
    # N or K not a multiple of 32, 1-D, wrong dtype, launcher buffers
    with pytest.raises(ValueError, match=r"w.shape\[0\] \(48\) must be a multiple of 32"):
        mxfp8_quantize_weight(torch.zeros(48, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"w.shape\[1\] \(40\) must be a multiple of 32"):
        mxfp8_quantize_weight_ref(torch.zeros(32, 40))
    with pytest.raises(ValueError, match="w must have at least 2 dimensions"):
        mxfp8_quantize_weight(torch.zeros(64, device=DEVICE))
    with pytest.raises(TypeError, match="w must have dtype"):
        mxfp8_quantize_weight(torch.zeros(32, 32, dtype=torch.int8, device=DEVICE))
    with pytest.raises(ValueError, match=r"scales must have shape \[1, 2\]"):
        mxfp8_quantize_weight_2d(torch.zeros(32, 64, device=DEVICE),
                                 torch.empty(32, 64, dtype=torch.uint8, device=DEVICE),
                                 torch.empty(32, 2, dtype=torch.uint8, device=DEVICE))
    assert isinstance(mxfp8_quantize_weight(torch.zeros(0, 32, 32, device=DEVICE)), MXFP8Weight)
