"""Determinism (issue 64, item 3): the forward and the backward give the same bits run to
run for fixed inputs, at EP 1 and 2: two calls in one process (one context; two training
steps with fresh leaves) and across launches (fresh processes, fresh buffers).

The inputs (``fuzz_plan.determinism_case``) have skew, disabled routes and a receive
bound that some routes exceed (the dropped path is part of the run). The suite's launch
(tests/reliability/conftest.py) makes both calls; a second launch makes one more. Compared
bit for bit: y of the inference forward, and y with the gradients of x, scores, w13 and w2
of the training step. On a GPU the same with the ranks sharing GPU 0; there the context's
second inference call is captured into a CUDA graph and replayed (``ops/graphs.py``), so
that comparison is eager against graph replay.
"""

import pytest
from conftest import launch_options
from fuzz_cases import bits, determinism_rank, same_bits

import distmoe as dm

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("reliability_suite")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("EP", [1, 2])
def test_forward_and_backward_bitwise_run_to_run(EP, device, suite):
    plan, per_rank = suite(EP, device)
    first = [r["determinism"] for r in per_rank]
    again = dm.launch(determinism_rank, EP, args=(plan["determinism"], device),
                      **launch_options(device))
    dropped = sum(r["dropped"] for r in first)
    assert dropped > 0 and dropped == sum(r["dropped"] for r in again), (
        "the fixed case exceeds the receive bound the same way in both launches")
    compared = 0
    for rank in range(EP):
        for kind in ("forward", "training"):
            calls = first[rank][kind] + again[rank][kind]  # two in one process, one more
            for call, outputs in enumerate(calls[1:], start=1):
                for i, (u, v) in enumerate(zip(calls[0], outputs, strict=True)):
                    where = "in the same process" if call == 1 else "in another launch"
                    assert same_bits(u, v), f"rank {rank}: {kind} output {i} differs {where}"
                    compared += bits(u).numel()
    print(f"determinism, EP={EP} on {device}: {compared} values bit-identical (two calls "
          f"in one process, one in another launch), {dropped} routes dropped per call")
