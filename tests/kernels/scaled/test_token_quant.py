"""quantize_tokens: activation rows quantised along the token axis in 128-token blocks per
column, transposed to [C, R_cap], against the plain-PyTorch rule bit for bit, on fresh random
rows spanning many decades with NaN, Inf and -0.0, partial and empty expert segments; read from
activation rows and through a gather table with null rows; outputs poisoned first and the
blocks past the padded rows checked untouched."""

import pytest
import torch

from distmoe.kernels.scaled.token_quant import (
    TOKEN_FORMATS,
    quantize_tokens,
    quantize_tokens_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layout(live):
    padded, act = [0], [0]
    for n in live:
        padded.append(padded[-1] + -(-n // 128) * 128)
        act.append(act[-1] + n)
    return torch.tensor(padded, dtype=torch.int32), torch.tensor(act, dtype=torch.int32)


def _poison(c, r_cap, fmt):
    qt = torch.full((c, r_cap), 0x7E, dtype=torch.uint8, device=DEV)
    sd = TOKEN_FORMATS[fmt]
    st = torch.full((r_cap // 128, c), 0xFE if sd == torch.uint8 else -7.0, dtype=sd,
                    device=DEV)
    return qt, st


def _expected(values_by_padded_row, padded, r_cap, c, fmt):
    """The rule per 128-row block of the padded rows (zeros where a row is not live)."""
    qt, st = _poison(c, r_cap, fmt)
    qt, st = qt.cpu(), st.cpu()
    for b in range(int(padded[-1]) // 128):
        block = values_by_padded_row[128 * b:128 * b + 128].T.contiguous()  # [C, 128]
        q, s = quantize_tokens_ref(block.float(), fmt)
        qt[:, 128 * b:128 * b + 128] = q.view(torch.uint8)
        st[b] = s
    return qt, st


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8_rebased"])
@pytest.mark.parametrize("gather", [False, True])
def test_quantize_tokens_matches_rule(fmt, gather):
    gen = torch.Generator().manual_seed(7 + gather)
    live, c = [130, 0, 50, 128], 96
    padded, act = _layout(live)
    r_cap = int(padded[-1]) + 128  # a spare block: not written
    n_act = int(act[-1])
    rows = (torch.randn(n_act + 3, c, generator=gen)
            * torch.logspace(-5, 5, c)[torch.randperm(c, generator=gen)]).bfloat16()
    rows[3, 5] = float("nan")
    rows[140, 7] = float("-inf")
    rows[200, 9] = -0.0
    rows[:, 11] = 0.0  # an all-zero column
    by_padded = torch.zeros(r_cap, c, dtype=torch.bfloat16)
    src_row = torch.full((r_cap,), -1)
    for e, n in enumerate(live):
        by_padded[int(padded[e]):int(padded[e]) + n] = rows[int(act[e]):int(act[e]) + n]
        src_row[int(padded[e]):int(padded[e]) + n] = torch.arange(int(act[e]), int(act[e]) + n)
    qt, st = _poison(c, r_cap, fmt)
    rows_d = rows.to(DEV)
    if gather:
        ptrs = rows_d.data_ptr() + src_row.clamp(min=0) * (c * 2)
        null = (torch.rand(r_cap, generator=gen) < 0.1) & (src_row >= 0)
        ptrs = torch.where(null | (src_row < 0), torch.zeros_like(ptrs), ptrs)
        ptrs[src_row < 0] = 8  # padding rows: an address never to be read
        by_padded[null] = 0
        quantize_tokens(None, padded.to(DEV), act.to(DEV), qt.view(torch.float8_e4m3fn), st,
                        format=fmt, gather_ptrs=ptrs.to(DEV))
    else:
        quantize_tokens(rows_d, padded.to(DEV), act.to(DEV), qt.view(torch.float8_e4m3fn), st,
                        format=fmt)
    want_q, want_s = _expected(by_padded, padded, r_cap, c, fmt)
    assert torch.equal(qt.cpu(), want_q)
    assert torch.equal(st.cpu().view(torch.uint8), want_s.view(torch.uint8))


def test_quantize_tokens_refusals():
    padded, act = _layout([3])
    padded, act = padded.to(DEV), act.to(DEV)
    rows = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEV)
    qt, st = _poison(64, 128, "fp8_block")
    with pytest.raises(ValueError, match=r"format \('mxfp8'\) must be one of"):
        quantize_tokens(rows, padded, act, qt, st, format="mxfp8")
    with pytest.raises(ValueError, match=r"R_cap \(96, qt.shape\[1\]\) must be a multiple of 128"):
        quantize_tokens(rows, padded, act, qt[:, :96].contiguous(), st, format="fp8_block")
    with pytest.raises(ValueError, match="pass exactly one of rows and gather_ptrs, got neither"):
        quantize_tokens(None, padded, act, qt, st, format="fp8_block")
    with pytest.raises(ValueError, match=r"rows must have C = 64"):
        quantize_tokens(rows[:, :32].contiguous(), padded, act, qt, st, format="fp8_block")
