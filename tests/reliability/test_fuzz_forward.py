"""Property-based fuzzing of the forward's routing and data movement (issue 64, item 1).

Hypothesis draws cases on the host (``fuzz_plan.case_strategy``): E_local, K (up to
E_local and one beyond), T_max and T (0 and T_max included), the row block, the id dtype
(int8, uint8, int16, int32, int64), the score dtype, skew (up to every token on one expert
or on one rank's experts), disabled, repeated and invalid ids, stray scores on disabled
routes (NaN included), the receive bound (roomy, hit exactly, exceeded by one row, a small
``device_scratch_factor``), x aligned or not, y returned or written through ``out=``, at
EP > 1 the way peer tokens reach W13 (all copied, or those named), and a second call on the
same context with new tokens, routing and T. The listed edge cases
(``fuzz_plan.edge_cases``) run first. One launch of EP ranks runs every case of that EP
size (tests/reliability/conftest.py), a context per case.

Checked per case: y against the reference on the routes that run (the rule of
tests/ops/forward_cases.py), tokens with no route run exactly zero; every rank's
``stats()`` deltas (``dropped_rows`` equal to the routes beyond its bound, computed by
``fuzz_cases.expected_routes``, ``invalid_ids``, ``last_recv_rows``, one call, no token
count mismatch); the call repeated with the routes that do not run disabled gives the same
bits (their contribution is absent, bit for bit); nothing written out of bounds (guard
bytes around every tensor passed and around ``out``, inputs unchanged, this rank's combine,
dispatch and h2 rows poisoned before the call and written exactly where the routing says,
every element of y written).

Drawn cases per EP size: ``DISTMOE_FUZZ_EXAMPLES`` (default 8 at EP 1 and 2, 3 at EP 3 and
4 on CPU ranks; 40 on a GPU); ``DISTMOE_FUZZ_SEED`` (default 0) draws other cases, e.g.
``DISTMOE_FUZZ_EXAMPLES=200 DISTMOE_FUZZ_SEED=1 pytest -n 0 tests/reliability``. A failing
case prints its ``Case(...)``; ``dm.launch(fuzz_cases.forward_fuzz_rank, EP,
args=([case],))`` runs it again. The GPU variant runs the same code with 1 to 4 ranks
sharing GPU 0 (the ``cuda_ipc`` heap).
"""

import pytest
from fuzz_cases import check_forward

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("reliability_suite")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("EP", [1, 2, 3, 4])
def test_forward_fuzz(EP, device, suite):
    plan, per_rank = suite(EP, device)
    tally, problems = check_forward(plan["forward"], [r["forward"] for r in per_rank])
    print(f"forward fuzz, EP={EP} on {device}: {tally.line()}")
    assert not problems, (f"{len(problems)} problems over {tally.line()}:\n"
                          + "\n".join(problems[:12]))
    # the edge cases hit the bound exactly and exceed it
    assert tally.bound_hit_exactly and tally.bound_exceeded, tally.line()
