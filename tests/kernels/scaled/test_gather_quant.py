"""gather_quantize: the FP8 layers' gather + quantise in one pass, checked bit for bit against
regather_rows followed by the format's quantiser, on fresh random rows (magnitudes over many
decades, so the rebase rounds some values), with null rows, empty experts and padding
rows holding addresses that must never be read; qdata and scales poisoned first, spare rows
checked untouched."""

import pytest
import torch

from distmoe.kernels.movement.regather_rows import regather_rows
from distmoe.kernels.scaled.gather_quant import GATHER_QUANT_FORMATS, gather_quantize
from distmoe.quant.fp8_block import fp8_block_quantize_2d
from distmoe.quant.mxfp8 import mxfp8_quantize_2d, mxfp8_quantize_rebased_2d

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QUANTIZE = {"mxfp8": mxfp8_quantize_2d, "mxfp8_rebased": mxfp8_quantize_rebased_2d,
            "fp8_block": fp8_block_quantize_2d}


def row_table(live, block_m, tokens, base, row_bytes, gen):
    """A gather table over ``tokens`` rows at ``base``, ``row_bytes`` apart, for experts with
    ``live`` rows each: ``(ptrs [R_cap] int64, padded_offsets, row_offsets int32)`` on the test
    device. Live rows name random tokens (with repeats), 15% of them null; padding rows,
    and a spare row tile after the last expert, hold address 8, which must never be read."""
    padded, act = [0], [0]
    for n in live:
        padded.append(padded[-1] + -(-n // block_m) * block_m)
        act.append(act[-1] + n)
    r_cap = padded[-1] + block_m
    which = torch.randint(0, tokens, (r_cap,), generator=gen)
    ptrs = base + which * row_bytes
    ptrs = torch.where(torch.rand(r_cap, generator=gen) < 0.15, torch.zeros_like(ptrs), ptrs)
    for e, n in enumerate(live):
        ptrs[padded[e] + n:padded[e + 1]] = 8
    ptrs[padded[-1]:] = 8
    return (ptrs.to(DEV), torch.tensor(padded, dtype=torch.int32, device=DEV),
            torch.tensor(act, dtype=torch.int32, device=DEV))


def _poisoned(rows, hidden, fmt):
    group, sdtype = GATHER_QUANT_FORMATS[fmt]
    q = torch.full((rows, hidden), 0x7F, dtype=torch.uint8, device=DEV)  # E4M3 NaN
    s = torch.full((rows, hidden // group), 0xFF if sdtype == torch.uint8 else float("nan"),
                   dtype=sdtype, device=DEV)
    return q, s


@pytest.mark.parametrize("fmt,hidden", [("mxfp8", 96), ("mxfp8", 512), ("mxfp8_rebased", 384),
                                        ("fp8_block", 128), ("fp8_block", 640)])
def test_gather_quantize_matches_regather_then_quantize(fmt, hidden):
    gen = torch.Generator().manual_seed(hidden)
    block_m = 16
    tokens = 29
    src = (torch.randn(tokens, hidden, generator=gen)
           * torch.logspace(-6, 6, hidden)[torch.randperm(hidden, generator=gen)])
    src = src.bfloat16().to(DEV)
    ptrs, padded, act = row_table([5, 0, 16, 35, 1], block_m, tokens, src.data_ptr(),
                                  hidden * 2, gen)
    rows = int(act[-1]) + 3

    q, s = _poisoned(rows, hidden, fmt)
    gather_quantize(ptrs, padded, act, q.view(torch.float8_e4m3fn), s, format=fmt,
                    block_m=block_m)  # as the layer passes it

    gathered = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=DEV)
    regather_rows(ptrs, padded, act, gathered, block_m=block_m)
    want_q, want_s = _poisoned(rows, hidden, fmt)
    QUANTIZE[fmt](gathered, want_q, want_s)
    n = int(act[-1])
    assert torch.equal(q[:n], want_q[:n])
    assert torch.equal(s[:n].view(torch.uint8), want_s[:n].view(torch.uint8))
    # spare rows untouched
    spare_q, spare_s = _poisoned(rows - n, hidden, fmt)
    assert torch.equal(q[n:], spare_q)
    assert torch.equal(s[n:].view(torch.uint8), spare_s.view(torch.uint8))


def test_gather_quantize_refusals():
    padded = torch.tensor([0, 16], dtype=torch.int32, device=DEV)
    act = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    ptrs = torch.zeros(16, dtype=torch.int64, device=DEV)
    q = torch.zeros(4, 256, dtype=torch.uint8, device=DEV)
    s = torch.zeros(4, 2, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match=r"format \('nvfp4'\) must be one of"):
        gather_quantize(ptrs, padded, act, q, s, format="nvfp4", block_m=16)
    with pytest.raises(ValueError, match=r"scales must have shape \[4, 8\]"):
        gather_quantize(ptrs, padded, act, q, torch.zeros(4, 2, dtype=torch.uint8, device=DEV),
                        format="mxfp8", block_m=16)
    with pytest.raises(ValueError, match=r"D \(96, qdata.shape\[1\]\) must be a positive "
                                         r"multiple of 128"):
        gather_quantize(ptrs, padded, act, q[:, :96].contiguous(), s[:, :1].contiguous(), format="fp8_block",
                        block_m=16)
    with pytest.raises(ValueError, match=r"block_m \(24\) must be a power of two"):
        gather_quantize(ptrs, padded, act, q, s, format="fp8_block", block_m=24)
