"""distmoe.tools.bench.layer_step: the inputs' argument checks (before anything is drawn), one
set of inputs shared by layers with different plans (the same bits where the kernels agree),
and the step on the CPU (Triton interpreter)."""

import pytest
import torch

from distmoe.tools.bench.layer_step import Joined, build_layer, draw_inputs, layer_step


def test_arguments_checked_first():
    joined = Joined(None, 0, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="mode must be"):
        layer_step("dense-e32", "bwd", joined)
    with pytest.raises(ValueError, match=r"tokens must be >= 1, got 0"):
        layer_step("dense-e32", "fwd", joined, tokens=0)
    with pytest.raises(ValueError, match=r"routing must be one of \('exact', 'sampled'\), "
                       r"got 'uniform'"):
        layer_step("dense-e32", "fwd", joined, routing="uniform")
    with pytest.raises(ValueError, match=r"EP \(3\) must divide the experts of dense-e32 \(32\)"):
        layer_step("dense-e32", "fwd", joined)


def test_inputs_are_drawn_once_and_shared():
    """Two layers on one set of inputs, the second with a plan override: the same output
    (the override changes a launch config, not the math), and the inputs seeded by rank."""
    from distmoe.tools.bench.groups import init_single_process_group

    group = init_single_process_group(torch.device("cpu"), backend="gloo")
    try:
        joined = Joined(None, 0, 1, torch.device("cpu"))
        inputs = draw_inputs("smoke", "fwd", joined, tokens=16, routing="exact")
        again = draw_inputs("smoke", "fwd", joined, tokens=16, routing="exact")
        assert inputs.tokens == 16 and not inputs.training
        assert torch.equal(inputs.x, again.x) and torch.equal(inputs.ids, again.ids)
        outs = []
        for overrides in (None, {"w13": {"num_stages": 3}}):
            ctx, _ = build_layer(inputs, joined, overrides=overrides)
            with ctx, torch.no_grad():
                outs.append(ctx(inputs.x, inputs.ids, inputs.scores, inputs.w13, inputs.w2))
                assert ("w13" in ctx.plan.overridden) == (overrides is not None)
        assert torch.equal(outs[0], outs[1])
    finally:
        group.close()
