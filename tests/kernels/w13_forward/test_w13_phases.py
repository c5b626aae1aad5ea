"""The two-launch W13 (distmoe.kernels.w13_forward.phases): own-token row blocks first, while the
peer tokens are still being copied, then the rest.

What must hold, and how each test can fail:

* the block order is the one the module docstring defines (compared entry by entry with a
  plain-Python reference, on random flags and expert sizes, with the unused tail of
  ``order`` poisoned), blocks with an own neighbour in their expert first;
* the first launch reads no pulled row: the pull buffer holds NaN while it runs (as if the
  copy had not landed), so a block wrongly taken first writes NaN rows, which the check
  against the reference catches; blocks of the second launch are still poisoned after it;
* both launches together write what one launch writes, bit for bit (h2 poisoned first).

Layouts follow the routing tables': each expert's rows in source-rank order (so a rank's own
rows are contiguous), then padding (null) up to 128 rows. The interpreter runs the Triton
kernel at small widths; the ``gpu`` tests add the Gluon kernels at Hopper tiles.
"""

from distmoe.kernels.base.interpreter import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()

import math  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.movement.pull_tokens import pull_tokens  # noqa: E402
from distmoe.kernels.w13_forward.config import W13Config  # noqa: E402
from distmoe.kernels.w13_forward.phases import (  # noqa: E402
    first_blocks,
    phase_waves,
    w13_phase_order,
    w13_phase_order_ref,
)
from distmoe.kernels.w13_forward.triton import gather_w13_swiglu, gather_w13_swiglu_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BM = 128
# rows per (expert, source rank) at EP=2: mixed, own-only and peer-only blocks on both ranks,
# an expert with no rows from one source, one that fits a single block
COUNTS = [(130, 100), (0, 260), (300, 5), (20, 0), (1, 1)]
SMALL = W13Config(block_m=BM, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("first", [0, 1, 5, 10_000])
def test_phase_order_matches_the_reference(seed, first):
    g = torch.Generator().manual_seed(seed)
    nb_cap = 3000  # more than one chunk of 1024 blocks
    # experts of 0 to 6 blocks (empty ones included), the rest of the capacity unused
    sizes = torch.randint(0, 7, (int(torch.randint(1, 700, (1,), generator=g)),), generator=g)
    po = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]) * BM
    n_b = int(po[-1]) // BM
    assert n_b <= nb_cap
    peer = (torch.rand(nb_cap, generator=g) < 0.5).to(torch.int8)
    peer[n_b:] = 0  # beyond the call: must not count as own blocks
    order = torch.full((nb_cap,), -7, dtype=torch.int32, device=DEVICE)
    positions = torch.full((4,), -7, dtype=torch.int32, device=DEVICE)
    starts = torch.full((nb_cap + 1,), 3, dtype=torch.int8, device=DEVICE)
    w13_phase_order(peer.to(DEVICE), po.to(torch.int32).to(DEVICE), order, positions, starts,
                    first=first)
    want_order, want_pos = w13_phase_order_ref(peer, po, first=first)
    assert order[:n_b].tolist() == want_order
    assert positions.tolist() == want_pos
    assert (order[n_b:] == -7).all()
    assert sorted(want_order) == list(range(n_b))
    assert want_pos[1] == min(first, int((peer[:n_b] == 0).sum()))


def test_phase_order_takes_blocks_with_an_own_neighbour_first():
    # experts of 3, 1 and 2 blocks; own blocks: 0 (alone in its expert: 1 is a peer's), 3
    # (a one-block expert), 4 and 5 (a pair)
    peer = torch.tensor([0, 1, 1, 0, 0, 0], dtype=torch.int8, device=DEVICE)
    po = torch.tensor([0, 3 * BM, 4 * BM, 6 * BM], dtype=torch.int32, device=DEVICE)
    order = torch.empty(6, dtype=torch.int32, device=DEVICE)
    positions = torch.empty(4, dtype=torch.int32, device=DEVICE)
    starts = torch.empty(7, dtype=torch.int8, device=DEVICE)
    for first, moved in ((1, [4]), (2, [4, 5]), (3, [0, 4, 5]), (9, [0, 3, 4, 5])):
        w13_phase_order(peer, po, order, positions, starts, first=first)
        n1 = len(moved)
        assert positions.tolist() == [0, n1, n1, 6]
        assert order.tolist() == moved + [b for b in range(6) if b not in moved], first


def test_phase_order_rejects_bad_arguments():
    peer = torch.zeros(4, dtype=torch.int8, device=DEVICE)
    po = torch.tensor([0, 256], dtype=torch.int32, device=DEVICE)
    order = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    starts = torch.zeros(5, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="first"):
        w13_phase_order(peer, po, order, pos, starts, first=-1)
    with pytest.raises(ValueError, match="order"):
        w13_phase_order(peer, po, order[:3], pos, starts, first=1)
    with pytest.raises(TypeError, match="positions"):
        w13_phase_order(peer, po, order, pos.float(), starts, first=1)
    with pytest.raises(ValueError, match="starts"):
        w13_phase_order(peer, po, order, pos, starts[:4], first=1)
    with pytest.raises(ValueError, match="waves"):
        first_blocks(waves=0, programs=132, num_pid_n=6)


def test_first_blocks_and_waves():
    # whole waves of 132 one-tile programs: 22 blocks of 6 column tiles, 8 of 16 (rounded down)
    assert first_blocks(waves=1, programs=132, num_pid_n=6) == 22
    assert first_blocks(waves=2, programs=132, num_pid_n=16) == 16
    assert first_blocks(waves=1, programs=2, num_pid_n=16) == 1
    # a copy shorter than the head start still gets one wave; a long one several
    assert phase_waves(copy_bytes=1 << 20, tile_flops=1 << 27) == 1
    short = phase_waves(copy_bytes=16 << 20, tile_flops=2 * 128 * 256 * 2048)
    long = phase_waves(copy_bytes=64 << 20, tile_flops=2 * 128 * 256 * 2048)
    assert 1 <= short < long


def _layout(rank: int, t_max: int, D: int, seed: int):
    """An EP=2 layer's tables for ``rank``: every rank's token rows (one tensor), the gather
    table in source-rank order per expert, the offsets, and how many own-only blocks exist."""
    g = torch.Generator().manual_seed(seed)
    heap = torch.randn(2, t_max, D, generator=g).to(torch.bfloat16).to(DEVICE)
    bases = torch.tensor([heap[s].data_ptr() for s in range(2)], dtype=torch.int64)
    ptrs, padded, live, own_blocks = [], [0], [0], 0
    for per_src in COUNTS:
        rows = []
        for s, n in enumerate(per_src):
            tok = torch.randint(0, t_max, (n,), generator=g)
            rows += (bases[s] + tok * D * 2).tolist()
        n = len(rows)
        seg = max(BM, math.ceil(n / BM) * BM) if n else 0
        src_of = [s for s, c in enumerate(per_src) for _ in range(c)] + [rank] * (seg - n)
        own_blocks += sum(all(src_of[i] == rank for i in range(b, b + BM))
                          for b in range(0, seg, BM))
        ptrs += rows + [0] * (seg - n)
        padded.append(padded[-1] + seg)
        live.append(live[-1] + n)
    ptrs[3] = 0  # a live row with a null address reads zeros
    r_cap = padded[-1] + 2 * BM  # unused blocks at the end
    ptrs += [0] * (r_cap - len(ptrs))
    as_dev = dict(dtype=torch.int32, device=DEVICE)
    return (heap, bases.to(DEVICE), torch.tensor(ptrs, dtype=torch.int64, device=DEVICE),
            torch.tensor(padded, **as_dev), torch.tensor(live, **as_dev), own_blocks)


def run_two_launches(config: W13Config, rank: int, first: int, *, D=64, F=64, t_max=40):
    heap, bases, ptrs, po, ro, own_blocks = _layout(rank, t_max, D, seed=11 + rank)
    E, r_cap, n_act = len(COUNTS), ptrs.shape[0], int(ro[-1])
    w13 = (torch.randn(E, 2, F, D, device=DEVICE) / D ** 0.5).to(torch.bfloat16)
    want = torch.full((n_act, F), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gather_w13_swiglu_ref(ptrs, po, ro, w13, want, sources=[heap])

    # the copy "has not landed": the pull buffer is NaN while the first launch runs
    pulled = torch.full((2 * t_max, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    table = torch.empty_like(ptrs)
    flags = torch.full((r_cap // BM,), 5, dtype=torch.int8, device=DEVICE)
    pull_tokens(ptrs, bases, rank, pulled, None, table, pulled=True, block_flags=flags)
    block_of = torch.arange(r_cap, device=DEVICE) // BM
    names_peer = (table >= pulled.data_ptr()) & (table < pulled.data_ptr() + pulled.nbytes)
    want_flags = torch.zeros(r_cap // BM, dtype=torch.int8, device=DEVICE)
    want_flags.index_put_((block_of[names_peer],), torch.ones((), dtype=torch.int8,
                                                              device=DEVICE))
    assert torch.equal(flags, want_flags)

    order = torch.full((r_cap // BM,), -1, dtype=torch.int32, device=DEVICE)
    positions = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    starts = torch.empty(r_cap // BM + 1, dtype=torch.int8, device=DEVICE)
    w13_phase_order(flags, po, order, positions, starts, first=first)
    n1 = min(first, own_blocks)
    assert positions.tolist() == [0, n1, n1, int(po[-1]) // BM]

    h2 = torch.full((n_act, F), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gather_w13_swiglu(table, po, ro, w13, h2, config=config, order=order,
                      positions=positions[0:2])
    # rows of the first launch's blocks are done (and finite); all others still poisoned
    act_of_block = _activation_rows_of_blocks(po, ro, order[:n1].tolist())
    done = torch.zeros(n_act, dtype=torch.bool, device=DEVICE)
    done[act_of_block] = True
    if n1:
        assert done.any()
        assert_close_bf16(h2[done], want[done], what="h2 after the first launch")
    assert torch.isnan(h2[~done].float()).all()

    # the copy lands; the second launch does the rest
    pulled.view(2, t_max, D).copy_(heap)
    gather_w13_swiglu(table, po, ro, w13, h2, config=config, order=order,
                      positions=positions[2:4])
    assert_close_bf16(h2, want, what="h2 after both launches")
    one = torch.full_like(h2, float("nan"))
    gather_w13_swiglu(table, po, ro, w13, one, config=config)
    assert torch.equal(h2.view(torch.int16), one.view(torch.int16))
    return n1


def _activation_rows_of_blocks(po, ro, blocks):
    rows = []
    po_l, ro_l = po.tolist(), ro.tolist()
    for b in blocks:
        start = b * BM
        e = max(i for i in range(len(po_l) - 1) if po_l[i] <= start)
        live = ro_l[e + 1] - ro_l[e]
        local = start - po_l[e]
        rows += [ro_l[e] + j for j in range(local, min(local + BM, live))]
    return torch.tensor(rows, dtype=torch.long, device=DEVICE)


def assert_close_bf16(actual, expected, *, what):
    """fp32-accumulated bf16 results against the reference's (fp32, rounded once): within
    2^-7 relative (two roundings of 2^-8) plus 1e-3 of the largest magnitude (accumulation
    order at D = 64)."""
    a, e = actual.float(), expected.float()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    tol = 2.0 ** -7 * e.abs() + 1e-3 * e.abs().max()
    bad = (a - e).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off"


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("first", [1, 2, 100])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "grid"])
def test_two_launches_read_no_pulled_row_first_and_give_the_same_bits(rank, first,
                                                                       persistent):
    n1 = run_two_launches(replace(SMALL, persistent=persistent), rank, first)
    assert n1 == min(first, 4 if rank == 0 else 3)  # own-only blocks of COUNTS


def test_first_launch_may_be_empty():
    assert run_two_launches(SMALL, 0, 0) == 0


def test_order_arguments_are_checked():
    heap, bases, ptrs, po, ro, _ = _layout(0, 8, 64, seed=1)
    w13 = torch.randn(len(COUNTS), 2, 64, 64, device=DEVICE).to(torch.bfloat16)
    h2 = torch.empty(int(ro[-1]), 64, dtype=torch.bfloat16, device=DEVICE)
    order = torch.zeros(ptrs.shape[0] // BM, dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        gather_w13_swiglu(ptrs, po, ro, w13, h2, config=SMALL, order=order)
    with pytest.raises(ValueError, match="order"):
        gather_w13_swiglu(ptrs, po, ro, w13, h2, config=SMALL, order=order[1:], positions=pos)
    with pytest.raises(ValueError, match="positions"):
        gather_w13_swiglu(ptrs, po, ro, w13, h2, config=SMALL, order=order,
                          positions=torch.zeros(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="block_flags"):
        pull_tokens(ptrs, bases, 0, torch.empty(16, 64, dtype=torch.bfloat16, device=DEVICE),
                    None, torch.empty_like(ptrs), pulled=True,
                    block_flags=torch.zeros(3, dtype=torch.int8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, warps", [(64, 4), (128, 8)], ids=["128x64", "128x128coop"])
@pytest.mark.parametrize("rank", [0, 1])
def test_gpu_two_launches_gluon(block_n, warps, rank):
    # the Gluon kernels the layer runs (128-row tiles), at Hopper widths
    config = W13Config(block_m=128, block_n=block_n, block_k=64, num_warps=warps,
                       num_stages=4, group_m=8, persistent=True, gluon=True)
    run_two_launches(config, rank, 2, D=1024, F=768, t_max=300)
