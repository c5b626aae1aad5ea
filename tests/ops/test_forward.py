"""Distributed bf16 forward on CPU ranks (Triton interpreter) against the reference."""

import pytest
from forward_cases import (
    CASES,
    check_against_reference,
    forward_cases_rank,
    forward_rank,
    make_problem,
)

import distmoe as dm

D, F = 32, 32


@pytest.mark.parametrize("EP", [1, 2, 4])
def test_forward_matches_reference(EP):
    # T=20 is not a multiple of the 16-row block; E=8 experts, K=2; every routing case
    T, E, K = 20, 8, 2
    names = sorted(CASES)
    per_rank = dm.launch(forward_cases_rank, EP, args=(1234 + EP, T, D, F, E, K, names))
    for i, case_name in enumerate(names):
        out = [r[i] for r in per_rank]
        check_against_reference(out, 1234 + EP, EP, T, D, F, E, K, case_name)
        ids = make_problem(1234 + EP, EP, T, D, F, E, K, case_name)[1]
        E_local = E // EP
        for rank, (_, stats) in enumerate(out):
            mine = ((ids >= rank * E_local) & (ids < (rank + 1) * E_local)).sum().item()
            assert stats["last_recv_rows"] == mine and stats["dropped_rows"] == 0, case_name


@pytest.mark.parametrize("EP, T, E, K", [
    (3, 9, 6, 1),   # EP=3, K=1
    (2, 5, 4, 4),   # K equal to the number of experts
    (3, 7, 3, 3),   # one expert per rank, K=E, odd T smaller than the row block
])
def test_forward_edge_shapes(EP, T, E, K):
    out = dm.launch(forward_rank, EP, args=(99, T, D, F, E, K, "balanced"))
    check_against_reference(out, 99, EP, T, D, F, E, K, "balanced")


def test_physical_t_below_max_tokens():
    # buffers sized for 32 tokens, calls with 11
    out = dm.launch(forward_rank, 2, args=(5, 11, D, F, 4, 2, "inactive_mix", "cpu", 16, 32))
    check_against_reference(out, 5, 2, 11, D, F, 4, 2, "inactive_mix")
