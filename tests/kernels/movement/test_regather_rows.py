"""regather_rows: the backward's copy of a saved layer's gathered rows, checked bit for bit
against a host loop on fresh random rows, with null rows, empty experts and padding, the
output poisoned (NaN) before the run so that any row written wrongly or not at all shows."""

import pytest
import torch

from distmoe.kernels.movement.regather_rows import regather_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layout(live, block_m, gen):
    """Padded segments (multiples of block_m, one spare block at the end) and the live rows'
    prefix sum for per-expert live counts ``live``."""
    padded, act = [0], [0]
    for n in live:
        padded.append(padded[-1] + -(-n // block_m) * block_m)
        act.append(act[-1] + n)
    r_cap = padded[-1] + block_m  # a spare block past the last segment: never written
    return (torch.tensor(padded, dtype=torch.int32), torch.tensor(act, dtype=torch.int32),
            r_cap)


@pytest.mark.parametrize("hidden", [64, 40, 1032])
@pytest.mark.parametrize("block_m", [16, 64])
def test_regather_matches_host_loop(hidden, block_m):
    gen = torch.Generator().manual_seed(hidden * 7 + block_m)
    live = [5, 0, block_m, 2 * block_m + 3, 1]  # an empty expert, whole and partial tiles
    padded, act, r_cap = _layout(live, block_m, gen)
    tokens = 37
    src = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEV)
    which = torch.randint(0, tokens, (r_cap,), generator=gen)
    null = torch.rand(r_cap, generator=gen) < 0.15
    ptrs = src.data_ptr() + which * hidden * 2
    ptrs = torch.where(null, torch.zeros_like(ptrs), ptrs)
    # padding rows hold garbage addresses: the kernel must never read them
    for e, n in enumerate(live):
        ptrs[padded[e] + n:padded[e + 1]] = 8
    ptrs[padded[-1]:] = 8
    rows = int(act[-1]) + 3  # spare rows after the live ones must stay untouched
    out = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=DEV)
    regather_rows(ptrs.to(DEV), padded.to(DEV), act.to(DEV), out, block_m=block_m)
    want = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    src_cpu = src.cpu()
    for e, n in enumerate(live):
        for j in range(n):
            p = int(padded[e]) + j
            want[int(act[e]) + j] = 0 if null[p] else src_cpu[which[p]]
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))  # NaNs too

    # enable = 0: nothing is written
    poisoned = torch.full_like(out, float("nan"))
    regather_rows(ptrs.to(DEV), padded.to(DEV), act.to(DEV), poisoned, block_m=block_m,
                  enable=torch.zeros(1, dtype=torch.int32, device=DEV))
    assert torch.isnan(poisoned.float()).all()


def test_regather_rejects_bad_arguments():
    padded = torch.tensor([0, 16], dtype=torch.int32, device=DEV)
    act = torch.tensor([0, 4], dtype=torch.int32, device=DEV)
    ptrs = torch.zeros(16, dtype=torch.int64, device=DEV)
    out = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(TypeError, match="gather_ptrs must have dtype int64"):
        regather_rows(ptrs.int(), padded, act, out, block_m=16)
    with pytest.raises(TypeError, match="out must have dtype bfloat16"):
        regather_rows(ptrs, padded, act, out.float(), block_m=16)
    with pytest.raises(ValueError, match=r"block_m \(24\) must be a power of two"):
        regather_rows(ptrs, padded, act, out, block_m=24)
    with pytest.raises(ValueError, match=r"R_cap \(16, rows of gather_ptrs\) must be a multiple"):
        regather_rows(ptrs, padded, act, out, block_m=32)
    with pytest.raises(ValueError, match="row_offsets must have shape"):
        regather_rows(ptrs, padded, act[:1], out, block_m=16)
    with pytest.raises(ValueError, match="enable must have shape"):
        regather_rows(ptrs, padded, act, out, block_m=16,
                      enable=torch.ones(2, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="D % 8 == 0"):
        regather_rows(ptrs, padded, act, torch.zeros(4, 60, dtype=torch.bfloat16, device=DEV),
                      block_m=16)
