"""local_routes: the gathered ids of every rank turned into this rank's local expert ids (-1
for another rank's expert, an inactive or an invalid route) and the invalid ones counted into
the device counter, against the rule in torch, bit for bit, on fresh random ids including
extreme int32 values; the output poisoned first, the counter added to (not overwritten)."""

import pytest
import torch

from distmoe.kernels.movement.local_routes import local_routes, local_routes_ref

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
E = 12


@pytest.mark.parametrize("base, num_local", [(0, 12), (0, 4), (4, 4), (8, 4), (11, 1)])
@pytest.mark.parametrize("N, K", [(1, 1), (37, 3), (700, 4)])
def test_matches_rule(base, num_local, N, K):
    gen = torch.Generator().manual_seed(N * 100 + base)
    ids = torch.randint(-3, E + 3, (N, K), generator=gen, dtype=torch.int32)
    wide = torch.tensor([2**31 - 1, -(2**31), 65537, -1, E, E - 1, 0], dtype=torch.int32)
    pick = torch.rand(N, K, generator=gen) < 0.2
    ids = torch.where(pick, wide[torch.randint(0, len(wide), (N, K), generator=gen)], ids)
    want, bad = local_routes_ref(ids, base=base, num_local=num_local, num_experts=E)
    out = torch.full((N, K), 0x5A5A5A5A, dtype=torch.int32, device=DEVICE)
    counter = torch.tensor(5, dtype=torch.int64, device=DEVICE)
    local_routes(ids.to(DEVICE), out, counter, base=base, num_local=num_local, num_experts=E)
    assert torch.equal(out.cpu(), want)
    assert int(counter) == 5 + bad
    assert bad == int(((ids < -1) | (ids >= E)).sum())
    assert ((out >= -1) & (out < num_local)).all()


def test_refusals():
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    counter = torch.zeros((), dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="ids must have dtype int32"):
        local_routes(ids.long(), ids, counter, base=0, num_local=2, num_experts=4)
    with pytest.raises(ValueError, match="out must have shape"):
        local_routes(ids, ids[:1], counter, base=0, num_local=2, num_experts=4)
    with pytest.raises(ValueError, match=r"base \(3\) and num_local \(2\)"):
        local_routes(ids, ids.clone(), counter, base=3, num_local=2, num_experts=4)
