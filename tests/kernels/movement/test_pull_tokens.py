"""pull_tokens: the peer tokens a W13 gather table names, copied once each into local memory,
and the table W13 reads instead.

Every rank's dispatch buffer is a region of one tensor here (the kernels only compare
addresses with the base table). Rows are random bf16 (never zeros), outputs are poisoned
first, and data movement is compared bit for bit: pulled slots equal their source tokens,
slots no row names keep the poison, the returned table is checked entry by entry, and the
flags are zero again after every call.
"""

from distmoe.kernels.base.interpreter import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.movement.pull_tokens import pull_tokens  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON_PTR = 0x7EAD_BEEF_0000


def _problem(ep, t_max, D, r_cap, rank, *, seed):
    """Dispatch regions of ``2 * t_max`` rows per rank (token rows 0..t_max-1, then route rows
    the forward never names); a table naming tokens of every rank, with repeats, nulls and a
    few rows past the token region (left in place)."""
    g = torch.Generator().manual_seed(seed)
    heap = torch.randn(ep, 2 * t_max, D, generator=g).to(torch.bfloat16).to(DEVICE)
    bases = torch.tensor([heap[s].data_ptr() for s in range(ep)], dtype=torch.int64)
    src = torch.randint(0, ep, (r_cap,), generator=g)
    tok = torch.randint(0, max(1, t_max // 2), (r_cap,), generator=g)  # many repeats
    kind = torch.randint(0, 10, (r_cap,), generator=g)
    row = torch.where(kind == 9, tok + t_max, tok)  # 10%: a row past the token region
    ptrs = bases[src] + row * (D * 2)
    ptrs[kind == 0] = 0  # 10%: null
    return heap, bases.to(DEVICE), src, row, ptrs.to(DEVICE)


@pytest.mark.parametrize("ep,rank,t_max,D,r_cap", [(2, 0, 24, 64, 80), (2, 1, 8, 1024, 48),
                                                    (4, 2, 20, 24, 131)])
def test_pull_tokens_copies_each_peer_token_once_and_rewrites_the_table(ep, rank, t_max, D,
                                                                        r_cap):
    heap, bases, src, row, ptrs = _problem(ep, t_max, D, r_cap, rank, seed=ep * 100 + D)
    dst = torch.full((ep * t_max, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    flags = torch.zeros(ep * t_max, dtype=torch.int8, device=DEVICE)
    out = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    before = ptrs.clone()
    assert pull_tokens(ptrs, bases, rank, dst, flags, out) is out

    assert torch.equal(ptrs, before) and not flags.any()
    pulled = (ptrs.cpu() != 0) & (src != rank) & (row < t_max)
    slot = src * t_max + row
    want = ptrs.cpu().clone()
    want[pulled] = dst.data_ptr() + slot[pulled] * D * 2
    assert torch.equal(out.cpu(), want)
    assert pulled.any() and (~pulled & (ptrs.cpu() != 0)).any()  # both kinds present
    got = dst.cpu().view(torch.int16)
    named = set(slot[pulled].tolist())
    for s in range(ep * t_max):
        if s in named:
            assert torch.equal(got[s], heap[s // t_max, s % t_max].cpu().view(torch.int16)), s
        else:
            assert torch.isnan(dst[s].float()).all(), f"slot {s} written"


def test_pull_tokens_second_call_and_disabled_call():
    ep, rank, t_max, D, r_cap = 2, 0, 16, 64, 64
    heap, bases, src, row, ptrs = _problem(ep, t_max, D, r_cap, rank, seed=7)
    dst = torch.full((ep * t_max, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    flags = torch.zeros(ep * t_max, dtype=torch.int8, device=DEVICE)
    out = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    off = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pull_tokens(ptrs, bases, rank, dst, flags, out, enable=off)
    assert torch.isnan(dst.float()).all() and (out == POISON_PTR).all() and not flags.any()
    pull_tokens(ptrs, bases, rank, dst, flags, out, enable=off + 1)
    first = dst.clone()
    # new values in the peer's tokens, the same table: a second call copies them again
    heap[1, :t_max] = torch.randn(t_max, D, device=DEVICE).to(torch.bfloat16)
    pull_tokens(ptrs, bases, rank, dst, flags, out)
    assert not flags.any()
    peer = (ptrs.cpu() != 0) & (src == 1) & (row < t_max)
    for s in set((src * t_max + row)[peer].tolist()):
        assert torch.equal(dst[s].view(torch.int16), heap[1, s - t_max].view(torch.int16))
        assert not torch.equal(dst[s].view(torch.int16), first[s].view(torch.int16))


def test_pull_tokens_rejects_bad_arguments_before_running():
    ptrs = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    bases = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    dst = torch.empty(2 * 8, 64, dtype=torch.bfloat16, device=DEVICE)
    flags = torch.zeros(16, dtype=torch.int8, device=DEVICE)
    out = torch.empty(16, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="src_ptrs must have dtype"):
        pull_tokens(ptrs.int(), bases, 0, dst, flags, out)
    with pytest.raises(ValueError, match=r"rank \(2\) must be an int in \[0, EP=2\)"):
        pull_tokens(ptrs, bases, 2, dst, flags, out)
    with pytest.raises(ValueError, match=r"dst must have EP \* T_max rows \(EP=2"):
        pull_tokens(ptrs, bases, 0, dst[:15], flags, out)
    with pytest.raises(ValueError, match=r"dst rows must be 16-byte aligned, got D=4"):
        pull_tokens(ptrs, bases, 0, dst[:, :4].contiguous(), flags, out)
    with pytest.raises(ValueError, match=r"flags must have shape \[16\]"):
        pull_tokens(ptrs, bases, 0, dst, flags[:8], out)
    with pytest.raises(ValueError, match="out_ptrs must have shape"):
        pull_tokens(ptrs, bases, 0, dst, flags, out[:8])
    with pytest.raises(ValueError, match="enable"):
        pull_tokens(ptrs, bases, 0, dst, flags, out, enable=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("ep,rank,t_max,D", [(2, 0, 24, 64), (4, 2, 20, 24), (2, 1, 8, 1024)])
def test_table_alone_when_the_tokens_are_pulled(ep, rank, t_max, D):
    """pull_tokens(pulled=True) writes the same table as the flagged pull, leaves dst alone
    and needs no flags (the caller has copied every peer token already)."""
    r_cap = 3 * t_max
    heap, bases, src, row, ptrs = _problem(ep, t_max, D, r_cap, rank, seed=ep * 10 + D)
    dst = torch.full((ep * t_max, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    assert pull_tokens(ptrs, bases, rank, dst, None, out, pulled=True) is out
    assert torch.isnan(dst.float()).all(), "dst written"
    flags = torch.zeros(ep * t_max, dtype=torch.int8, device=DEVICE)
    ref = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    pull_tokens(ptrs, bases, rank, dst, flags, ref)  # the flagged pull into the same dst
    assert torch.equal(out, ref) and (out != POISON_PTR).all()
    assert not flags.any(), "flags left set"
    with pytest.raises(TypeError, match=r"flags must be a torch.Tensor, got NoneType"):
        pull_tokens(ptrs, bases, rank, dst, None, out)  # the flagged pull needs its flags


@pytest.mark.parametrize("ep,rank,t_max,D,T", [(2, 1, 24, 64, 24), (4, 2, 20, 24, 13)])
def test_table_reads_own_tokens_from_the_caller_when_given(ep, rank, t_max, D, T):
    """With ``own_src`` (the caller's x [T, D]) rows naming this rank's token t name row t of
    x instead; peer rows and other addresses are as without it, and nothing is copied."""
    r_cap = 3 * t_max
    heap, bases, src, row, ptrs = _problem(ep, t_max, D, r_cap, rank, seed=ep * 7 + D)
    own = (ptrs.cpu() != 0) & (src == rank) & (row < t_max)
    ptrs[(own & (row >= T)).to(DEVICE)] = 0  # a call of T tokens names rows below T only
    own &= row < T
    x = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
    dst = torch.full((ep * t_max, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    base = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    out = base.clone()
    pull_tokens(ptrs, bases, rank, dst, None, base, pulled=True)
    assert pull_tokens(ptrs, bases, rank, dst, None, out, pulled=True, own_src=x) is out
    assert torch.isnan(dst.float()).all(), "dst written"
    want = base.cpu().clone()
    want[own] = x.data_ptr() + row[own] * D * 2
    assert own.any() and torch.equal(out.cpu(), want)
    assert (want != POISON_PTR).all()


def test_ep1_table_reads_the_callers_rows_without_a_pull_buffer():
    """At EP = 1 (``dst=None``): every row naming the dispatch buffer's token t names row t
    of x; null rows and rows past the token region stay; nothing else is needed."""
    t_max, D, T, r_cap = 24, 64, 17, 70
    heap, bases, src, row, ptrs = _problem(1, t_max, D, r_cap, 0, seed=5)
    ptrs[((ptrs.cpu() != 0) & (row < t_max) & (row >= T)).to(DEVICE)] = 0  # T tokens only
    x = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
    out = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    assert pull_tokens(ptrs, bases, 0, None, None, out, own_src=x, t_max=t_max) is out
    own = (ptrs.cpu() != 0) & (row < T)
    want = ptrs.cpu().clone()
    want[own] = x.data_ptr() + row[own] * D * 2
    assert own.any() and (row >= t_max).any() and torch.equal(out.cpu(), want)
    with pytest.raises(ValueError, match=r"dst may be None only at EP = 1 with own_src and "
                                         r"t_max .*t_max=None"):
        pull_tokens(ptrs, bases, 0, None, None, out, own_src=x)
    with pytest.raises(ValueError, match=r"dst may be None only at EP = 1 .*EP=2"):
        pull_tokens(ptrs, torch.cat([bases, bases]), 0, None, None, out, own_src=x,
                    t_max=t_max)
    with pytest.raises(ValueError, match=r"t_max \(0\) must be a positive int"):
        pull_tokens(ptrs, bases, 0, None, None, out, own_src=x, t_max=0)
    with pytest.raises(ValueError, match=r"own_src must be \[T <= 8, 64\]"):
        pull_tokens(ptrs, bases, 0, None, None, out, own_src=x, t_max=8)
    with pytest.raises(ValueError, match=r"t_max \(24\) is for dst=None only"):
        pull_tokens(ptrs, bases, 0, torch.empty(t_max, D, dtype=torch.bfloat16, device=DEVICE),
                    None, out, pulled=True, t_max=t_max)


def test_own_src_is_checked_before_running():
    ptrs = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    bases = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    dst = torch.empty(2 * 8, 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.full((16,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    x = torch.empty(9 * 64 + 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"own_src must be \[T <= 8, 64\], got \[9, 64\]"):
        pull_tokens(ptrs, bases, 0, dst, None, out, pulled=True, own_src=x[:9 * 64].view(9, 64))
    with pytest.raises(ValueError, match="own_src must be 16-byte aligned"):
        pull_tokens(ptrs, bases, 0, dst, None, out, pulled=True,
                    own_src=x[1:1 + 4 * 64].view(4, 64))
    with pytest.raises(TypeError, match="own_src must have dtype"):
        pull_tokens(ptrs, bases, 0, dst, None, out, pulled=True,
                    own_src=torch.zeros(4, 64, device=DEVICE))
    assert (out == POISON_PTR).all()


def test_pull_tokens_copies_the_first_copy_elems_only():
    """copy_elems (rows holding a packed format in their first bytes): each pulled slot gets
    its token's first copy_elems values bit for bit, and the rest of the slot keeps the
    poison; a width that is not a multiple of 8 in [8, D] is refused."""
    ep, rank, t_max, D, r_cap, copy = 2, 1, 12, 64, 40, 24
    heap, bases, src, row, ptrs = _problem(ep, t_max, D, r_cap, rank, seed=7)
    dst = torch.full((ep * t_max, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    flags = torch.zeros(ep * t_max, dtype=torch.int8, device=DEVICE)
    out = torch.full((r_cap,), POISON_PTR, dtype=torch.int64, device=DEVICE)
    pull_tokens(ptrs, bases, rank, dst, flags, out, copy_elems=copy)
    pulled = (ptrs.cpu() != 0) & (src != rank) & (row < t_max)
    assert pulled.any()
    got, want = dst.cpu(), heap.cpu()
    for s, r in set(zip(src[pulled].tolist(), row[pulled].tolist(), strict=True)):
        slot = got[s * t_max + r]
        assert torch.equal(slot[:copy].view(torch.int16), want[s, r, :copy].view(torch.int16))
        assert bool(slot[copy:].isnan().all())
    for bad in (0, 12, D + 8, 8.0):
        with pytest.raises(ValueError, match="copy_elems"):
            pull_tokens(ptrs, bases, rank, dst, flags, out, copy_elems=bad)
