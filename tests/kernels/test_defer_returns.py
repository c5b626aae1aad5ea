"""The deferred returns (inference, EP > 1): W2's return table rewritten so that every
``every``-th peer route slot stays in the expert's region, and the owner's combine reading
those rows there (distmoe.kernels.defer_returns, combine's DeferredReads).

Addresses are compared exactly; the combine against itself without deferral, bit for bit
(the same rows summed in the same order), with every row it must not read NaN."""

from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

ON_INTERPRETER = use_interpreter_if_no_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.combine import CombineConfig, DeferredReads, combine  # noqa: E402
from distmoe.kernels.defer_returns import (  # noqa: E402
    defer_returns,
    defer_returns_ref,
    region_rows,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
COMBINE_SMALL = CombineConfig(block_t=4, block_d=32, num_warps=4)


@pytest.mark.parametrize("every", [1, 2, 3, 5])
def test_defer_returns_matches_the_reference(every):
    g = torch.Generator().manual_seed(every)
    EP, T, K, rank, n = 3, 137, 4, 1, 1500  # n: not a multiple of the kernel's block
    routes = torch.randperm(EP * T * K, generator=g)[:n]  # a route has at most one row
    routes[torch.rand(n, generator=g) < 0.2] = -1
    scatter = torch.where(routes >= 0, torch.randint(1, 2**40, (n,), generator=g) * 16, 0)
    segment, _ = region_rows(T, K, every, EP)
    kw = dict(rank=rank, routes_per_rank=T * K, every=every, segment=segment,
              region_base=0x7F0000001000, row_bytes=64)
    routes, scatter = routes.to(DEVICE), scatter.to(DEVICE)
    want = defer_returns_ref(scatter, routes, **kw)
    out = torch.full_like(scatter, -7)
    got = defer_returns(scatter, routes, out, **kw)
    assert got is out and torch.equal(got, want)
    owner = torch.div(routes, T * K, rounding_mode="floor")
    moved = (routes >= 0) & (owner != rank) & ((routes % (T * K)) % every == 0)
    assert moved.any() and (~moved & (routes >= 0)).any()
    assert torch.equal(got[~moved], scatter[~moved])  # own routes and null rows keep theirs
    # the region rows of distinct routes are distinct, and inside the region
    rows = (got[moved] - kw["region_base"]) // kw["row_bytes"]
    assert rows.unique().numel() == rows.numel() and int(rows.max()) < EP * segment
    # in place
    inplace = scatter.clone()
    defer_returns(inplace, routes, inplace, **kw)
    assert torch.equal(inplace, want)


def test_defer_returns_rejects_bad_arguments():
    s = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    kw = dict(rank=0, routes_per_rank=8, every=2, segment=4, region_base=256, row_bytes=64)
    with pytest.raises(ValueError, match=r"segment \(3\) x every \(2\) must cover the "
                                         r"routes_per_rank = 8 slots"):
        defer_returns(s, s, s.clone(), **dict(kw, segment=3))
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        defer_returns(s, s, s.clone(), **dict(kw, every=0))
    with pytest.raises(ValueError, match="region_base must be 16-byte aligned"):
        defer_returns(s, s, s.clone(), **dict(kw, region_base=264))
    with pytest.raises(ValueError, match=r"route_of_row must have shape \[8\]"):
        defer_returns(s, s[:4], s.clone(), **kw)
    with pytest.raises(TypeError, match="out must have dtype"):
        defer_returns(s, s, s.int(), **kw)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        region_rows(8, 2, 0, 2)


@pytest.mark.parametrize("every", [1, 3])
def test_combine_reads_deferred_rows_where_the_experts_kept_them(every):
    """Rank 1 of EP=3 (2 experts per rank): every route at a slot divisible by ``every``
    whose expert is on rank 0 or 2 is NaN in the local rows and sits in that rank's region
    (a separate tensor per rank here) at row 1 * segment + slot / every; everything else in
    the regions is NaN. y is the combine of the true rows without deferral, bit for bit."""
    g = torch.Generator().manual_seed(40 + every)
    EP, E_l, rank, T, T_max, K, D = 3, 2, 1, 13, 16, 3, 48
    ids = torch.randint(0, EP * E_l, (T, K), generator=g)
    ids[torch.rand(T, K, generator=g) < 0.25] = -1
    scores = torch.rand(T, K, generator=g)
    rows = torch.randn(T_max * K, D, generator=g).bfloat16()
    segment, _ = region_rows(T_max, K, every, EP)
    regions = [torch.full((EP * segment + 1, D), float("nan"), dtype=torch.bfloat16)
               for _ in range(EP)]
    local = rows.clone()
    slots = torch.arange(T * K).view(T, K)
    far = (ids >= 0) & (torch.div(ids, E_l, rounding_mode="floor") != rank) & \
        (slots % every == 0)
    assert far.any() and (~far & (ids >= 0)).any()
    for t, k in far.nonzero().tolist():
        s = t * K + k
        regions[int(ids[t, k]) // E_l][rank * segment + s // every] = rows[s]
        local[s] = float("nan")
    local[:T * K][(ids < 0).reshape(-1)] = float("nan")  # inactive: never read
    to = {"device": DEVICE}
    regions = [r.to(**to) for r in regions]
    want = combine(rows.to(**to), ids.to(**to), scores.to(**to),
                   torch.full((T, D), float("nan"), dtype=torch.bfloat16, **to),
                   config=COMBINE_SMALL)
    bases = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64, **to)
    deferred = DeferredReads(ids.to(**to), E_l, rank, every, segment, bases)
    got = combine(local.to(**to), ids.to(**to), scores.to(**to),
                  torch.full((T, D), float("nan"), dtype=torch.bfloat16, **to),
                  config=COMBINE_SMALL, deferred=deferred)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.isnan(got.float()).any()


def test_combine_rejects_bad_deferred_reads():
    ids = torch.zeros(5, 2, dtype=torch.int64, device=DEVICE)
    rows = torch.zeros(12, 16, dtype=torch.bfloat16, device=DEVICE)
    y = torch.zeros(5, 16, dtype=torch.bfloat16, device=DEVICE)
    bases = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    ok = dict(expert_ids=ids, experts_per_rank=2, rank=0, every=2, segment=5, bases=bases)
    for change, match in ((dict(every=0), "deferred.every must be an int >= 1"),
                          (dict(segment=4), r"segment \(4\) x every \(2\) must cover the "
                                            r"T\*K = 10"),
                          (dict(rank=2), r"deferred.rank must be an int in \[0, 2\)"),
                          (dict(expert_ids=ids[:, :1].contiguous()),
                           r"deferred.expert_ids must have shape \[5, 2\]"),
                          (dict(bases=bases.int()), "deferred.bases must have dtype")):
        with pytest.raises((TypeError, ValueError), match=match):
            combine(rows, ids, ids.float(), y, deferred=DeferredReads(**dict(ok, **change)))
    with pytest.raises(TypeError, match="deferred must be a DeferredReads"):
        combine(rows, ids, ids.float(), y, deferred=ok)
