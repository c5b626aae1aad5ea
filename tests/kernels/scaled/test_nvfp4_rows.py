"""NVFP4 rows packed on the source and gathered decoded (distmoe.kernels.scaled.nvfp4_rows), bit
for bit: the packed slot holds nvfp4_quantize's codes, block scales and per-row global scale
(bytes past it untouched); the gather writes bf16 ``v * s_b`` and ``s_g`` per live row, equal
to the plain-PyTorch decode, with null rows (zeros, scale 0), empty experts and padding rows
whose addresses must never be read; outputs poisoned first, spare rows checked untouched. The
W13 GEMM's per-row scale against its reference is in test_nvfp4_weight_mm.py."""

import pytest
import torch
from test_gather_quant import row_table

from distmoe.kernels.scaled.nvfp4_rows import (
    gather_nvfp4_rows,
    gather_nvfp4_rows_ref,
    nvfp4_row_layout,
    pack_nvfp4_rows,
    unpack_nvfp4_rows,
)
from distmoe.quant.nvfp4 import nvfp4_quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 0xA5


def _rows(tokens, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen) * torch.logspace(-4, 4, tokens)[:, None]
    x[1, 3] = 40.0 * x[1].abs().max()  # one outlier: its block's scale, the row's global
    return x.bfloat16().to(DEV)


@pytest.mark.parametrize("hidden", [16, 96, 256])
def test_layout_fits_a_bf16_slot(hidden):
    scales_at, global_at, num_bytes = nvfp4_row_layout(hidden)
    assert scales_at == hidden // 2 and global_at % 16 == 0
    assert global_at >= scales_at + hidden // 16 and num_bytes <= 2 * hidden
    for bad in (0, 24, 17.0, True):
        with pytest.raises(ValueError, match="hidden"):
            nvfp4_row_layout(bad)


@pytest.mark.parametrize("hidden", [32, 160])
def test_pack_writes_the_quantiser_bits_and_nothing_past_them(hidden):
    tokens = 7
    x = _rows(tokens, hidden, hidden)
    slots = torch.full((tokens + 2, 2 * hidden), POISON, dtype=torch.uint8, device=DEV)
    pack_nvfp4_rows(x, slots)
    packed, scales, gs = unpack_nvfp4_rows(slots[:tokens], hidden)
    want = nvfp4_quantize(x, per="row")
    assert torch.equal(packed, want[0])
    assert torch.equal(scales.view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(gs, want[2])
    scales_at, global_at, num_bytes = nvfp4_row_layout(hidden)
    gap = slots[:tokens, scales_at + hidden // 16:global_at]
    assert bool((gap == POISON).all()) and bool((slots[:tokens, num_bytes:] == POISON).all())
    assert bool((slots[tokens:] == POISON).all())


@pytest.mark.parametrize("hidden", [48, 256, 608])  # 608: three column tiles, one partial
def test_gather_matches_the_reference(hidden):
    gen = torch.Generator().manual_seed(7 + hidden)
    block_m = 16
    live = [5, 0, 16, 21, 1]
    tokens = 23
    slots = torch.full((tokens, 2 * hidden), POISON, dtype=torch.uint8, device=DEV)
    pack_nvfp4_rows(_rows(tokens, hidden, hidden + 1), slots)
    ptrs, padded, act = row_table(live, block_m, tokens, slots.data_ptr(), 2 * hidden, gen)
    rows = int(act[-1]) + 3

    def poisoned():
        return (torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=DEV),
                torch.full((rows,), float("nan"), dtype=torch.float32, device=DEV))

    out, scale = poisoned()
    gather_nvfp4_rows(ptrs, padded, act, out, scale, block_m=block_m)
    want, want_scale = poisoned()
    base = slots.data_ptr()
    gather_nvfp4_rows_ref(lambda address: slots[(address - base) // (2 * hidden)], ptrs,
                          padded, act, want, want_scale)
    n = int(act[-1])
    assert torch.equal(out[:n].view(torch.int16), want[:n].view(torch.int16))
    assert torch.equal(scale[:n], want_scale[:n]) and bool((scale[:n] >= 0).all())
    assert bool(out[n:].isnan().all()) and bool(scale[n:].isnan().all())  # spare rows
    # the live rows' addresses in activation order: some are null, and those read zeros
    nulls = torch.cat([ptrs[int(padded[e]):int(padded[e]) + count] == 0
                       for e, count in enumerate(live)])
    assert bool(nulls.any())
    assert bool((out[:n][nulls] == 0).all()) and bool((scale[:n][nulls] == 0).all())


def test_refusals():
    padded = torch.tensor([0, 16], dtype=torch.int32, device=DEV)
    act = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    ptrs = torch.zeros(16, dtype=torch.int64, device=DEV)
    out = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=r"row_scale must have shape \[4\]"):
        gather_nvfp4_rows(ptrs, padded, act, out, torch.zeros(3, device=DEV), block_m=16)
    with pytest.raises(ValueError, match="hidden"):
        gather_nvfp4_rows(ptrs, padded, act, torch.zeros(4, 24, dtype=torch.bfloat16,
                                                         device=DEV),
                          torch.zeros(4, device=DEV), block_m=16)
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=r"slots must be \[>= 2, 64\]"):
        pack_nvfp4_rows(x, torch.zeros(2, 32, dtype=torch.uint8, device=DEV))
