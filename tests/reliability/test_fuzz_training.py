"""Property-based fuzzing of the training path (issue 64, item 1): gradients under fuzzed
routing.

Cases drawn by the forward's strategy with T >= 1 (autograd needs a token), the slot
budget (inputs only: every layer replays in backward; balanced full save: layers save or
replay by their rows) and what a saved layer keeps (``fuzz_cases.SAVING``), at EP 1 and 2, fewer of them (the backward costs about twice the
forward in Triton's interpreter), after the edge cases with T >= 1. They run in the same
launch as the forward cases (tests/reliability/conftest.py). Per case: one forward and
backward of a ``cfg.training=True`` context on poisoned peer buffers; y and the gradients
of x, scores, w13 and w2 against torch autograd of the reference on the routes that run
(the rule of tests/ops/test_training.py), zero score gradients for the routes that do not
run, the stats deltas, guard bytes around every tensor passed and the inputs unchanged,
and the step repeated with the routes that do not run disabled gives the same bits (y and
every gradient).

Drawn cases per EP size: a third of ``DISTMOE_FUZZ_EXAMPLES`` (default 2 on CPU ranks, 13
on a GPU); ``DISTMOE_FUZZ_SEED`` draws other cases (tests/reliability/fuzz_plan.py).
"""

import pytest
from fuzz_cases import check_training

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("reliability_suite")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("EP", [1, 2])
def test_training_fuzz(EP, device, suite):
    plan, per_rank = suite(EP, device)
    tally, problems = check_training(plan["training"], [r["training"] for r in per_rank])
    print(f"training fuzz, EP={EP} on {device}: {tally.line()}")
    assert not problems, (f"{len(problems)} problems over {tally.line()}:\n"
                          + "\n".join(problems[:12]))
    assert tally.bound_hit_exactly and tally.bound_exceeded, tally.line()
