"""pull_rows: peer rows copied once into local memory, and the table the GEMM reads instead.

A "peer" buffer and a "local" buffer are two tensors of this process (the kernel only compares
addresses with the local range). Rows are random bf16 (never zeros); every output is poisoned
first. Data movement is compared bit for bit: pulled rows equal their sources, rows that must
not be written keep the poison, and the returned table is checked entry by entry.
"""

from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.pull_rows import pull_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON_PTR = 0x7EAD_BEEF_0000


def _case(r_cap, D, used, *, seed):
    """Rows 20..49 of one buffer are "local"; rows 0..19 and 50..69 around them stand for peer
    rows, so rows 19 and 50 sit right at both ends of the local range."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(70, D, generator=g).to(torch.bfloat16).to(DEVICE)
    local = buf[20:50]
    kind = torch.randint(0, 3, (r_cap,), generator=g)  # 0 null, 1 local, 2 peer
    kind[used:] = 0  # the tables hold 0 past the used rows
    row = torch.randint(20, 50, (r_cap,), generator=g)
    peer_row = torch.randint(0, 40, (r_cap,), generator=g)
    peer_row = torch.where(peer_row < 20, peer_row, peer_row + 30)
    row = torch.where(kind == 2, peer_row, row)
    if used >= 2:  # peer rows right at both ends of the local range
        kind[:2] = 2
        row[:2] = torch.tensor([19, 50])
    ptrs = torch.zeros(r_cap, dtype=torch.int64)
    ptrs[kind != 0] = buf.data_ptr() + row[kind != 0] * D * 2
    return buf, local, kind, row, ptrs.to(DEVICE)


@pytest.mark.parametrize("r_cap,D,used", [(48, 64, 40), (64, 1024, 64), (33, 24, 17), (16, 64, 0)])
def test_pull_rows_copies_peer_rows_once_and_rewrites_their_entries(r_cap, D, used):
    peer, local, kind, row, ptrs = _case(r_cap, D, used, seed=r_cap * 1000 + D)
    dst = torch.full((r_cap, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    used_rows = torch.tensor([used], dtype=torch.int32, device=DEVICE)
    ptrs_before = ptrs.clone()
    assert pull_rows(ptrs, used_rows, dst, out, local) is out

    assert torch.equal(ptrs, ptrs_before)  # the source table is not written
    want = ptrs.cpu().clone()
    is_peer = kind == 2
    want[is_peer] = dst.data_ptr() + torch.nonzero(is_peer).flatten() * D * 2
    assert torch.equal(out.cpu(), want)
    got, src = dst.cpu(), peer.cpu()
    for p in range(r_cap):
        if kind[p] == 2:
            assert torch.equal(got[p].view(torch.int16), src[row[p]].view(torch.int16)), p
        else:
            assert torch.isnan(got[p].float()).all(), f"row {p} (kind {int(kind[p])}) written"


def test_pull_rows_disabled_touches_nothing():
    peer, local, kind, row, ptrs = _case(32, 64, 32, seed=5)
    dst = torch.full((32, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = torch.full((32,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    used_rows = torch.tensor([32], dtype=torch.int64, device=DEVICE)
    off = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pull_rows(ptrs, used_rows, dst, out, local, enable=off)
    assert torch.isnan(dst.float()).all() and (out == POISON_PTR).all()
    pull_rows(ptrs, used_rows, dst, out, local, enable=off + 1)
    assert int((out != ptrs).sum()) == int((kind == 2).sum()) > 0


def test_pull_rows_rejects_bad_arguments_before_running():
    ptrs = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    used = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    dst = torch.empty(16, 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(16, dtype=torch.int64, device=DEVICE)
    local = torch.empty(8, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="src_ptrs"):
        pull_rows(ptrs.int(), used, dst, out, local)
    with pytest.raises(ValueError, match=r"dst must be contiguous with R_cap \(16\) rows"):
        pull_rows(ptrs, used, dst[:8], out, local)
    with pytest.raises(ValueError, match="out_ptrs"):
        pull_rows(ptrs, used, dst, out[:8], local)
    with pytest.raises(ValueError, match=r"dst rows must be 16-byte aligned, got D=4"):
        pull_rows(ptrs, used, dst[:, :4].contiguous(), out, local)
    with pytest.raises(ValueError, match="enable"):
        pull_rows(ptrs, used, dst, out, local, enable=torch.zeros(2, dtype=torch.int32))
