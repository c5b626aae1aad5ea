"""Every quantiser and the row dequantiser on an input wider than 65535 column tiles, against the
plain-PyTorch reference bit for bit: CUDA caps grid axes 1 and 2 at 65535 programs, and the
quantisers of a flattened expert weight (``[E, 2F * D]``, one global scale per expert) need
more. The kernels launch one-axis grids (``tile_grid``); under the interpreter the cap does
not exist, so this runs on a GPU only."""

import pytest
import torch

from distmoe.quant import fp8_block_quantize, mxfp8_quantize
from distmoe.quant.formats import QuantLaunchConfig
from distmoe.quant.fp8_block import fp8_block_quantize_ref
from distmoe.quant.mxfp8 import mxfp8_quantize_ref
from distmoe.quant.mxfp8_weight import mxfp8_quantize_weight, mxfp8_quantize_weight_ref
from distmoe.quant.nvfp4 import nvfp4_quantize, nvfp4_quantize_ref
from distmoe.quant.prepare import dequantize_rows, dequantize_rows_ref

pytestmark = pytest.mark.gpu
NARROW = QuantLaunchConfig(block_rows=32, block_groups=1, num_warps=4)  # one block a program
TILES = 65536 + 3  # column tiles: past the axis-1 cap


def _wide(rows, cols, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device="cuda")
    return (x * torch.exp2(torch.randint(-20, 20, (rows, cols), generator=g,
                                         device="cuda"))).bfloat16()


def _same(got, want):
    """Bit for bit, every output (a per-tensor global scale is a 0-dim tensor: its bytes are
    compared through a 1-element view)."""
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                  b.reshape(-1).view(torch.uint8))


def test_nvfp4_per_row_and_per_tensor():
    x = _wide(3, 16 * TILES, 1)  # a 16-value block per program
    for per in ("row", "tensor"):
        _same(nvfp4_quantize(x, per=per, config=NARROW), nvfp4_quantize_ref(x, per=per))


def test_mxfp8_rows_and_weights():
    x = _wide(3, 32 * TILES, 2)
    _same(mxfp8_quantize(x, config=NARROW), mxfp8_quantize_ref(x))
    w = _wide(32, 32 * TILES, 3)
    got, want = mxfp8_quantize_weight(w, config=NARROW), mxfp8_quantize_weight_ref(w)
    _same((got.qdata, got.scales), (want.qdata, want.scales))


def test_fp8_block_and_dequantize():
    x = _wide(2, 128 * TILES, 4)  # fp8_block: one 128-value block per program
    q, s = fp8_block_quantize(x)
    _same((q, s), fp8_block_quantize_ref(x))
    x = _wide(1, 256 * TILES, 5)  # the dequantiser's 256-column tile
    q, s = mxfp8_quantize(x)
    got = dequantize_rows(q, s, "mxfp8", dtype=torch.float32)
    got_bits, want_bits = got.view(torch.int32), dequantize_rows_ref(
        q, s, "mxfp8", dtype=torch.float32).view(torch.int32)
    assert torch.equal(got_bits, want_bits)
