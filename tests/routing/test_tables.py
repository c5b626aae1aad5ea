"""Routing tables against an independent loop construction, bit-exactly."""

import pytest
import torch

from distmoe.reference import random_routing
from distmoe.routing import build_routing_tables, row_capacity

ROW_BYTES = 64 * 2
DISPATCH = torch.tensor([10_000_000, 20_000_000, 30_000_000, 40_000_000])
COMBINE = torch.tensor([50_000_000, 60_000_000, 70_000_000, 80_000_000])


def loop_tables(ids, rank, E_local, block, bound, training):
    """Walk experts in order and routes in (src, t, k) order: the obvious way. A route runs
    iff fewer than ``bound`` routes to this rank come before it."""
    EP, T, K = ids.shape
    cap = row_capacity(bound, E_local, block)
    gather = [0] * cap
    scatter = [0] * cap
    bwd = [0] * cap
    offsets = [0]
    compact = [0]
    recv = dropped = 0
    for e in range(E_local):
        g = rank * E_local + e
        routes = [(s, t, k) for s in range(EP) for t in range(T) for k in range(K)
                  if int(ids[s, t, k]) == g]
        base = offsets[-1]
        executed = 0
        for j, (s, t, k) in enumerate(routes):
            recv += 1
            if recv > bound:
                dropped += 1
                continue
            row = base + j
            executed += 1
            gather[row] = int(DISPATCH[s]) + t * ROW_BYTES
            scatter[row] = int(COMBINE[s]) + (t * K + k) * ROW_BYTES
            bwd[row] = int(DISPATCH[s]) + (t * K + k) * ROW_BYTES
        offsets.append(base + -(-executed // block) * block)
        compact.append(compact[-1] + executed)
    assert offsets[-1] <= cap
    return offsets, compact, gather, scatter, bwd, recv, dropped


def ids_for(EP, T, K, E, kind):
    if kind == "random":
        ids = torch.stack([random_routing(T, E, K, inactive_fraction=0.25)[0] for _ in range(EP)])
    elif kind == "one_expert":  # all tokens to expert 1 (K=1)
        ids = torch.full((EP, T, K), 1)
    elif kind == "all_inactive":
        ids = torch.full((EP, T, K), -1)
    return ids.to(torch.int16)


IMPLS = pytest.mark.parametrize("impl", ["torch", "fused", "blocked"])


def activation_rows_of_routes(tabs, EP, T, K):
    """Inverse of every rank's tables: flat route ``src*T*K + t*K + k`` -> the activation row
    its destination rank executes it at (from route_of_row and the offsets), -1 elsewhere."""
    rows = torch.full((EP * T * K,), -1, dtype=torch.int64)
    for tab in tabs:
        po, ro = tab.padded_offsets.tolist(), tab.row_offsets.tolist()
        for e in range(len(po) - 1):
            for j in range(ro[e + 1] - ro[e]):
                route = int(tab.route_of_row[po[e] + j])
                assert route >= 0 and rows[route] == -1
                rows[route] = ro[e] + j
    return rows.view(EP, T, K)


@IMPLS
@pytest.mark.parametrize("kind", ["random", "one_expert", "all_inactive"])
@pytest.mark.parametrize("EP, T, K, E, block", [(3, 7, 2, 6, 4), (1, 5, 3, 4, 16), (4, 9, 4, 8, 2)])
def test_tables_match_loop_construction(kind, EP, T, K, E, block, impl):
    if kind == "one_expert":
        K = 1
    ids = ids_for(EP, T, K, E, kind)
    E_local = E // EP
    tabs = []
    for rank in range(EP):
        bound = EP * T * K
        tab = build_routing_tables(ids, rank=rank, num_local_experts=E_local, row_block=block,
                                   receive_bound=bound, dispatch_bases_EP=DISPATCH[:EP],
                                   combine_bases_EP=COMBINE[:EP], row_bytes=ROW_BYTES,
                                   training=True, impl=impl)
        offsets, compact, gather, scatter, bwd, recv, dropped = loop_tables(
            ids, rank, E_local, block, bound, True)
        assert tab.padded_offsets.tolist() == offsets
        assert tab.row_offsets.tolist() == compact
        executed_EP = [loop_tables(ids, r, E_local, block, bound, True)[1][-1]
                       for r in range(EP)]
        assert tab.executed_rows_EP.tolist() == executed_EP
        assert torch.equal(tab.gather_ptrs, torch.tensor(gather))
        assert torch.equal(tab.scatter_ptrs, torch.tensor(scatter))
        assert torch.equal(tab.bwd_scatter_ptrs, torch.tensor(bwd))
        assert int(tab.num_recv_rows) == recv and int(tab.num_dropped_rows) == dropped == 0
        assert torch.equal(tab.is_route_executed_TK, (ids[rank] >= 0))
        tabs.append(tab)
    # every owner knows the row its route lands at on the destination rank
    dest = activation_rows_of_routes(tabs, EP, T, K)
    for rank, tab in enumerate(tabs):
        assert tab.dest_rows_TK.dtype == torch.int32
        assert torch.equal(tab.dest_rows_TK.long(), dest[rank])


@IMPLS
def test_overflow_is_counted_and_never_written_past_capacity(impl):
    EP, T, K, block = 2, 16, 2, 4  # E = 4 experts, 2 per rank
    ids = torch.zeros(EP, T, K, dtype=torch.int16)
    ids[:, :, 1] = 1  # rank 0 receives all 64 routes
    bound = 22  # far below 64, not a multiple of the block
    cap = row_capacity(bound, 2, block)
    tab = build_routing_tables(ids, rank=0, num_local_experts=2, row_block=block,
                               receive_bound=bound, dispatch_bases_EP=DISPATCH[:EP],
                               combine_bases_EP=COMBINE[:EP], row_bytes=ROW_BYTES,
                               training=False, impl=impl)
    offsets, compact, gather, scatter, _, recv, dropped = loop_tables(ids, 0, 2, block, bound,
                                                                      False)
    assert tab.gather_ptrs.shape == (cap,) and tab.bwd_scatter_ptrs is None
    assert tab.padded_offsets.tolist() == offsets == [0, 24, 24]
    assert tab.row_offsets.tolist() == compact == [0, 22, 22]
    assert tab.executed_rows_EP.tolist() == [22, 0]
    assert torch.equal(tab.gather_ptrs, torch.tensor(gather))
    assert torch.equal(tab.scatter_ptrs, torch.tensor(scatter))
    assert int(tab.num_recv_rows) == 64 and int(tab.num_dropped_rows) == dropped == 42
    # Rank 0's own routes: expert 0 rows 0..15 fit (its tokens come first), expert 1 none.
    executed = torch.zeros(T, K, dtype=torch.bool)
    executed[:, 0] = True
    assert torch.equal(tab.is_route_executed_TK, executed)
    # Rank 1 computes the same fate for its routes without any communication.
    tab1 = build_routing_tables(ids, rank=1, num_local_experts=2, row_block=block,
                                receive_bound=bound, dispatch_bases_EP=DISPATCH[:EP],
                                combine_bases_EP=COMBINE[:EP], row_bytes=ROW_BYTES,
                                training=False, impl=impl)
    executed1 = torch.zeros(T, K, dtype=torch.bool)
    executed1[:6, 0] = True  # expert 0 rows 16..21 are rank 1's first 6 tokens
    assert torch.equal(tab1.is_route_executed_TK, executed1)
    assert int(tab1.num_recv_rows) == 0
    # destination rows of executed routes (rank 0 runs them all), -1 for dropped ones
    dest = activation_rows_of_routes([tab, tab1], EP, T, K)
    assert torch.equal(tab.dest_rows_TK.long(), dest[0])
    assert torch.equal(tab1.dest_rows_TK.long(), dest[1])
    assert tab.dest_rows_TK[:, 0].tolist() == list(range(16))
    assert tab1.dest_rows_TK[:6, 0].tolist() == list(range(16, 22))
    assert (tab1.dest_rows_TK[6:, 0] == -1).all() and (tab.dest_rows_TK[:, 1] == -1).all()


def _both(ids, *, device=None, **kw):
    if device is not None:
        ids = ids.to(device)
        for name in ("dispatch_bases_EP", "combine_bases_EP"):
            kw[name] = kw[name].to(device)
    return [build_routing_tables(ids, impl=impl, **kw) for impl in ("torch", "fused", "blocked")]


def _assert_same_tables(a, b):
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


@pytest.mark.parametrize("seed", range(6))
def test_fused_tables_equal_torch_tables(seed, monkeypatch, device=None):
    """Random calls, bit for bit: EP 1-4, drops under a small receive bound, inactive and
    invalid ids (int64 values that would wrap into range as int32), every id dtype; the
    blocked path with 64 routes per program (several blocks)."""
    from distmoe.routing import fused

    monkeypatch.setattr(fused, "BLOCKED_ROUTES_PER_PROGRAM", 64)
    g = torch.Generator().manual_seed(seed)
    EP = [1, 2, 3, 4, 2, 1][seed]
    E_local = int(torch.randint(1, 9, (1,), generator=g))
    T = int(torch.randint(1, 40, (1,), generator=g))
    K = int(torch.randint(1, min(4, EP * E_local) + 1, (1,), generator=g))
    E = EP * E_local
    block = [2, 4, 16, 128, 8, 32][seed]
    ids = torch.randint(-1, E, (EP, T, K), generator=g, dtype=torch.int64)
    if seed % 2:  # invalid ids, counted and treated as inactive
        ids[0, 0, 0] = E
        ids[-1, -1, -1] = -5
        ids[0, -1, 0] = 2**32 + 1  # 1 after an int32 wrap
    dtype = [torch.int16, torch.int32, torch.int64][seed % 3]
    if dtype != torch.int64:
        ids = ids.clamp(-2, E).to(dtype)
    bound = max(1, int(EP * T * K * [1.0, 0.3, 0.6][seed % 3]))
    for rank in range(EP):
        for training in (False, True):
            a, *others = _both(ids, device=device, rank=rank, num_local_experts=E_local,
                               row_block=block, receive_bound=bound,
                               dispatch_bases_EP=DISPATCH[:EP], combine_bases_EP=COMBINE[:EP],
                               row_bytes=ROW_BYTES, training=training)
            for b in others:
                _assert_same_tables(a, b)


@pytest.mark.gpu
def test_fused_tables_equal_torch_tables_gpu():
    # The compiled kernel (CTA barriers between scratch writes and reads, 4-8 warps).
    cuda = torch.device("cuda")
    mp = pytest.MonkeyPatch()
    try:
        for seed in range(6):
            test_fused_tables_equal_torch_tables(seed, mp, device=cuda)
        test_blocked_tables_many_blocks(16, (4, 16), mp, device=cuda)
    finally:
        mp.undo()
    test_fused_tables_largest_call(device=cuda)  # 1024 routes per program (the default)


def test_fused_tables_largest_call(device=None):
    # At the size limit (4096 routes, the largest in-register sort) with many experts. On
    # the interpreter only rank 1 (its tables start past rank 0's rows; about 35 s a rank),
    # on a GPU both.
    from distmoe.routing.fused import MAX_FUSED_ROUTES

    EP, K, E = 2, 8, 256
    T = MAX_FUSED_ROUTES // (EP * K)
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([random_routing(T, E, K, generator=g)[0] for _ in range(EP)])
    kw = dict(num_local_experts=E // EP, row_block=128, receive_bound=T * K + 100,
              dispatch_bases_EP=DISPATCH[:EP], combine_bases_EP=COMBINE[:EP],
              row_bytes=ROW_BYTES, training=True)
    for rank in range(EP) if device is not None else (EP - 1,):
        a, *others = _both(ids, device=device, rank=rank, **kw)
        for b in others:
            _assert_same_tables(a, b)
    if device is not None:
        return
    with pytest.raises(ValueError, match=r"impl='fused' takes at most 4096 routes"):
        build_routing_tables(torch.zeros(EP, T + 1, K, dtype=torch.int16), rank=0,
                             impl="fused", **kw)
    with pytest.raises(ValueError, match=r"impl \('sorted'\) must be"):
        build_routing_tables(ids, rank=0, impl="sorted", **kw)


@pytest.mark.parametrize("block, prefix", [(16, (32, 64)), (64, (32, 64)), (16, (4, 16))])
def test_blocked_tables_many_blocks(block, prefix, monkeypatch, device=None):
    """The blocked path across many blocks (positions carried between blocks, counters
    summed by atomics) equals the torch construction, with drops and an invalid id; with
    ``prefix`` = (blocks per step, keys per program) of the prefix over blocks small, its
    carry crosses steps and its programs split the keys."""
    from distmoe.routing import fused

    monkeypatch.setattr(fused, "BLOCKED_ROUTES_PER_PROGRAM", block)
    monkeypatch.setattr(fused, "_PREFIX_ROWS", prefix[0])
    monkeypatch.setattr(fused, "_PREFIX_COLS", prefix[1])
    g = torch.Generator().manual_seed(block)
    EP, T, K, E_local = 3, 37, 3, 5
    ids = torch.randint(-1, EP * E_local, (EP, T, K), generator=g)
    ids[1, 3, 2] = 99  # invalid
    kw = dict(num_local_experts=E_local, row_block=8, receive_bound=90,
              dispatch_bases_EP=DISPATCH[:EP], combine_bases_EP=COMBINE[:EP],
              row_bytes=ROW_BYTES)
    if device is not None:
        ids = ids.to(device)
        kw["dispatch_bases_EP"] = kw["dispatch_bases_EP"].to(device)
        kw["combine_bases_EP"] = kw["combine_bases_EP"].to(device)
    dropped = 0
    for rank in range(EP):
        for training in (False, True):
            want = build_routing_tables(ids, rank=rank, training=training, impl="torch", **kw)
            got = build_routing_tables(ids, rank=rank, training=training, impl="blocked", **kw)
            _assert_same_tables(want, got)
            assert int(got.num_invalid_ids) == 1
            dropped += int(got.num_dropped_rows)
    assert dropped > 0  # the receive bound bites somewhere


@pytest.mark.parametrize(
    "EP, T, K, E_local, block, bound, dtype",
    [
        (1, 0, 2, 4, 16, 8, torch.int16),  # no tokens: an empty layout
        (2, 9, 3, 7, 4, 0, torch.int32),  # receive bound 0: everything dropped
        (1, 11, 3, 14, 8, 20, torch.int64),  # E + 2 = 16, a power of two (tight expert lanes)
        (1, 13, 4, 15, 8, 30, torch.int16),  # E + 1 = 16: one lane short if EB were E + 1
        (8, 5, 8, 1, 256, 50, torch.int32),  # EP 8, K = E, row block 256
        (1, 17, 4, 200, 16, 40, torch.int8),  # narrow ids with E above the int8 range
        (1, 17, 4, 200, 16, 40, torch.uint8),
    ],
)
def test_tables_edge_cases(EP, T, K, E_local, block, bound, dtype, monkeypatch):
    """Every implementation against the torch construction at the edges: no tokens, a zero
    receive bound, tight expert lanes, wide groups, narrow id dtypes, strided base tables."""
    from distmoe.routing import fused

    monkeypatch.setattr(fused, "BLOCKED_ROUTES_PER_PROGRAM", 16)
    E = EP * E_local
    g = torch.Generator().manual_seed(T * 31 + E)
    if K == E:  # every token picks every expert
        ids = torch.arange(E).repeat(EP, T, 1)
    else:
        ids = torch.randint(-1, E, (EP, T, K), generator=g)
    if dtype == torch.uint8:
        ids = ids.clamp(min=0)  # no -1 in an unsigned dtype
        if ids.numel():
            ids.view(-1)[0] = 255  # invalid (>= E)
    ids = ids.to(dtype) if dtype != torch.int8 else ids.clamp(max=127).to(dtype)
    # strided base tables (every other entry of a wider table)
    wide = torch.stack([torch.arange(EP) * 10**9 + 10**6, torch.zeros(EP, dtype=torch.int64)], 1)
    kw = dict(num_local_experts=E_local, row_block=block, receive_bound=bound,
              dispatch_bases_EP=wide[:, 0], combine_bases_EP=wide[:, 0] + 5 * 10**8,
              row_bytes=ROW_BYTES)
    assert EP == 1 or not kw["dispatch_bases_EP"].is_contiguous()
    for rank in sorted({0, EP - 1}):
        for training in (False, True):
            want = build_routing_tables(ids, rank=rank, training=training, impl="torch", **kw)
            for impl in ("fused", "blocked"):
                got = build_routing_tables(ids, rank=rank, training=training, impl=impl, **kw)
                _assert_same_tables(want, got)


def test_auto_choice_depends_on_shapes_alone():
    from distmoe.routing.fused import AUTO_FUSED_ROUTES, MAX_FUSED_EXPERTS, auto_impl

    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    assert auto_impl(16, 128, cuda) == "fused"
    assert auto_impl(AUTO_FUSED_ROUTES, 128, cuda) == "fused"
    assert auto_impl(AUTO_FUSED_ROUTES + 1, 128, cuda) == "blocked"
    assert auto_impl(1 << 20, 256, cuda) == "blocked"
    assert auto_impl(16, MAX_FUSED_EXPERTS - 1, cuda) == "torch"
    assert auto_impl(1 << 20, MAX_FUSED_EXPERTS - 2, cuda) == "blocked"



@pytest.mark.parametrize("nb, eb, rows, cols", [(1, 16, 32, 64), (37, 64, 8, 16),
                                                (64, 256, 32, 64)])
def test_block_prefix_equals_cumsum(nb, eb, rows, cols):
    """The prefix over blocks (step 2a of the blocked path) is torch.cumsum over dim 0,
    exactly, with the output poisoned first and random counts."""
    from distmoe.routing import fused

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(nb * eb)
    hist = torch.randint(0, 1000, (nb, eb), generator=g, dtype=torch.int32).to(device)
    incl = torch.full_like(hist, -7)
    fused._block_prefix_kernel[(-(-eb // cols),)](hist, incl, nb, EB=eb, COLS=cols, ROWS=rows)
    assert torch.equal(incl.cpu(), torch.cumsum(hist.cpu(), 0, dtype=torch.int32))
