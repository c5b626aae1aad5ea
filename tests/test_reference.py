"""The reference layer against an independent float64 einsum formulation."""

import pytest
import torch

from distmoe.reference import (
    merge_expert_tensors,
    merge_rank_outputs,
    moe_reference,
    random_routing,
    split_global_problem,
)


def einsum_reference(x, ids, scores, w13, w2):
    """Dense formulation: run every expert on every token, then mask with one-hot routing."""
    E = w13.shape[0]
    onehot = torch.zeros(*ids.shape, E, dtype=x.dtype)
    active = ids >= 0
    onehot[active.nonzero(as_tuple=True) + (ids[active],)] = 1.0
    gate = torch.einsum("td,efd->tef", x, w13[:, 0])
    up = torch.einsum("td,efd->tef", x, w13[:, 1])
    h2 = gate * torch.sigmoid(gate) * up
    h3 = torch.einsum("tef,edf->ted", h2, w2)
    weight = torch.einsum("tke,tk->te", onehot, scores.to(x.dtype))
    return torch.einsum("te,ted->td", weight, h3)


def problem(T=13, D=16, F=24, E=6, K=3, dtype=torch.float64, inactive=0.3):
    x = torch.randn(T, D, dtype=dtype)
    w13 = torch.randn(E, 2, F, D, dtype=dtype) / D**0.5
    w2 = torch.randn(E, D, F, dtype=dtype) / F**0.5
    ids, scores = random_routing(T, E, K, inactive_fraction=inactive, dtype=dtype)
    ids[0] = -1  # an all-inactive token
    scores[0] = 0
    return x, ids, scores, w13, w2


def test_forward_matches_einsum_in_float64():
    x, ids, scores, w13, w2 = problem()
    y = moe_reference(x, ids, scores, w13, w2)
    assert y.dtype == torch.float64
    # Same math in a different order of operations: fp64 rounding only.
    torch.testing.assert_close(y, einsum_reference(x, ids, scores, w13, w2), rtol=1e-10, atol=1e-10)
    assert torch.equal(y[0], torch.zeros_like(y[0]))  # all-inactive row is exact zero


def test_backward_matches_einsum_in_float64():
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in problem()]
    x, ids, scores, w13, w2 = inputs
    gy = torch.randn(x.shape, dtype=x.dtype)
    grads = torch.autograd.grad((moe_reference(x, ids, scores, w13, w2) * gy).sum(),
                                [x, scores, w13, w2])
    grads_ref = torch.autograd.grad((einsum_reference(x, ids, scores, w13, w2) * gy).sum(),
                                    [x, scores, w13, w2])
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_bf16_inputs_compute_in_bf16_and_return_bf16():
    x, ids, scores, w13, w2 = problem(dtype=torch.float64, inactive=0.0)
    y64 = moe_reference(x, ids, scores, w13, w2)
    y16 = moe_reference(x.bfloat16(), ids, scores.float(), w13.bfloat16(), w2.bfloat16())
    assert y16.dtype == torch.bfloat16
    # bf16 has 8 significant bits; inputs, h1, h2 and h3 are each rounded once.
    torch.testing.assert_close(y16.double(), y64, rtol=5e-2, atol=5e-2)


def test_int16_and_int32_ids_give_the_same_result():
    x, ids, scores, w13, w2 = problem()
    y = moe_reference(x, ids, scores, w13, w2)
    for dt in (torch.int16, torch.int32):
        assert torch.equal(moe_reference(x, ids.to(dt), scores, w13, w2), y)


def test_split_and_merge_roundtrip_per_rank_equals_global():
    ep = 3
    x, ids, scores, w13, w2 = problem(T=12, E=6)
    parts = split_global_problem(x, ids, scores, w13, w2, ep)
    assert [p.x.shape[0] for p in parts] == [4, 4, 4]
    assert torch.equal(merge_rank_outputs([p.x for p in parts]), x)
    assert torch.equal(merge_expert_tensors([p.w13 for p in parts]), w13)
    assert torch.equal(merge_expert_tensors([p.w2 for p in parts]), w2)
    # Token-parallel + expert-parallel: each rank's output equals its rows of the global one.
    y = moe_reference(x, ids, scores, w13, w2)
    full_w13 = merge_expert_tensors([p.w13 for p in parts])
    for r, p in enumerate(parts):
        yr = moe_reference(p.x, p.expert_ids, p.scores, full_w13, w2)
        # fp64 matmuls over different row counts may block differently: rounding only.
        torch.testing.assert_close(yr, y[r * 4:(r + 1) * 4], rtol=1e-12, atol=1e-12)


def test_bad_ids_are_rejected():
    x, ids, scores, w13, w2 = problem()
    ids[1, 0] = 6
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[-1, 6\)"):
        moe_reference(x, ids, scores, w13, w2)
