"""MoEExperts at a low precision (inference): the bf16 parameters are prepared once per weight
version and the forward gives the bits of the context called with
``distmoe.prepare_weights`` of the same parameters (CPU, one rank, Triton's interpreter); an
in-place change of a parameter (an optimizer's step, a load) prepares them again."""

import pytest
import torch

import distmoe as dm
from distmoe.nn import MoEExperts
from distmoe.reference import random_routing

T, D, F, E, K = 8, 128, 128, 2, 1


# nvfp4 takes the same path (expert_weights does not look at the precision past bf16); its
# quantiser at these widths takes minutes in the interpreter
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
def test_prepared_once_per_weight_version(precision):
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       precision=precision, training=False, row_block=16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, scores = random_routing(T, E, K, generator=g)
    with MoEExperts(cfg, device="cpu", seed=3, init_std=D**-0.5) as m, torch.no_grad():
        y = m(x, ids, scores)
        first = m.expert_weights()
        assert m.expert_weights() is first  # the same version: not quantised again
        want = m.context(x, ids, scores, *dm.prepare_weights(m.w13, m.w2, precision))
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
        m.w2.mul_(0.5)  # in place: a new version
        again = m.expert_weights()
        assert again is not first
        y2 = m(x, ids, scores)
        want2 = m.context(x, ids, scores, *dm.prepare_weights(m.w13, m.w2, precision))
        assert torch.equal(y2.view(torch.int16), want2.view(torch.int16))
        assert not torch.equal(y2, y)


def test_training_takes_the_parameters():
    """A training module at mxfp8 passes its bf16 parameters (the context quantises them) and
    its backward fills every gradient: the bits of the context called directly."""
    cfg = dm.MoEConfig(hidden=64, ffn=32, num_experts=E, top_k=K, max_tokens=T,
                       precision="mxfp8", training=True, row_block=16)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, 64, generator=g).bfloat16().requires_grad_(True)
    ids, scores = random_routing(T, E, K, generator=g)
    with MoEExperts(cfg, device="cpu", seed=3, init_std=0.1) as m:
        assert all(a is b for a, b in zip(m.expert_weights(), (m.w13, m.w2), strict=True))
        y = m(x, ids, scores)
        y.float().sum().backward()
        want = m.context(x.detach().requires_grad_(True), ids, scores, m.w13, m.w2)
        assert torch.equal(y.detach().view(torch.int16), want.detach().view(torch.int16))
        want.float().sum().backward()  # every forward gets its backward
        assert x.grad.abs().sum() > 0 and m.w13.grad.abs().sum() > 0
        assert m.w2.grad.abs().sum() > 0
