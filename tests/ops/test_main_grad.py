"""MoEContext(main_grad=True): weight gradients added in fp32 into ``w13.main_grad`` and
``w2.main_grad`` (Megatron's convention), on CPU ranks at EP 1 and 2.

Rule for the comparison with the default path (bf16 ``.grad`` per backward): both run the
same WGRAD arithmetic in fp32; the default rounds each micro-batch's gradient once to bf16
(relative error at most 2^-9), main_grad adds the fp32 values. So over two micro-batches
``|main_grad - (g1_bf16 + g2_bf16)| <= 2^-9 (|g1| + |g2|)`` elementwise, up to the fp32
summation order of the kernels (a tile order may differ between the accumulating and the
storing launch): we allow 2^-8 (|g1| + |g2|) plus 1e-6 of the largest value. x and score
gradients do not depend on where the weight gradients go: bit-equal.
"""

import pytest
import torch
from forward_cases import make_problem

import distmoe as dm
from distmoe.reference import split_global_problem

D, F, T, E, K = 32, 32, 20, 8, 2


def _cfg(world, training=True):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=training, row_block=16, device_scratch_factor=float(world))


def _two_microbatches(ctx, weights, problems, upstreams):
    """Backward of two micro-batches through one layer; x and score grads of each."""
    out = []
    for p, gy in zip(problems, upstreams, strict=True):
        x = p.x.clone().requires_grad_(True)
        s = p.scores.clone().requires_grad_(True)
        y = ctx(x, p.expert_ids, s, *weights)
        (y.float() * gy).sum().backward()
        out += [x.grad, s.grad]
    return out


def _main_grad_rank(rank, world):
    cfg = _cfg(world)
    problems = [split_global_problem(*make_problem(50 + i, world, T, D, F, E, K, "balanced"),
                                     world)[rank] for i in range(2)]
    g = torch.Generator().manual_seed(9 + rank)
    upstreams = [torch.randn(T, D, generator=g).bfloat16().float() for _ in range(2)]
    w13 = problems[0].w13.clone().requires_grad_(True)
    w2 = problems[0].w2.clone().requires_grad_(True)
    with dm.MoEContext(cfg, device="cpu") as ctx:
        default_grads = []
        for i in range(2):  # each micro-batch alone: its bf16 weight gradients
            w13.grad = w2.grad = None
            _two_microbatches(ctx, (w13, w2), problems[i:i + 1], upstreams[i:i + 1])
            default_grads.append((w13.grad.float(), w2.grad.float()))
        w13.grad = w2.grad = None
        reference_xs = _two_microbatches(ctx, (w13, w2), problems, upstreams)
    w13.grad = w2.grad = None
    w13.main_grad = torch.full_like(w13, 0.25, dtype=torch.float32)  # starts non-zero
    w2.main_grad = torch.full_like(w2, -0.5, dtype=torch.float32)
    with dm.MoEContext(cfg, device="cpu", main_grad=True) as ctx:
        xs = _two_microbatches(ctx, (w13, w2), problems, upstreams)
    same_xs = all(torch.equal(a, b) for a, b in zip(xs, reference_xs, strict=True))
    return dict(main=(w13.main_grad - 0.25, w2.main_grad + 0.5), default=default_grads,
                grads_none=(w13.grad is None, w2.grad is None), same_xs=same_xs)


@pytest.mark.parametrize("EP", [1, 2])
def test_main_grad_accumulates_fp32_weight_gradients(EP):
    for r, out in enumerate(dm.launch(_main_grad_rank, EP, timeout=300)):
        assert out["grads_none"] == (True, True), (r, out["grads_none"])
        assert out["same_xs"], f"rank {r}: x or score gradients differ with main_grad"
        for i, name in enumerate(("w13", "w2")):
            got = out["main"][i]
            g1, g2 = out["default"][0][i], out["default"][1][i]
            bound = 2.0**-8 * (g1.abs() + g2.abs()) + 1e-6 * (g1.abs() + g2.abs()).max()
            err = (got - (g1 + g2)).abs()
            assert bool((err <= bound).all()), (
                f"rank {r} {name}: max error {err.max().item():.3g} above the bound "
                f"(worst excess {(err - bound).max().item():.3g})")
            assert bool((got != 0).any()), f"rank {r} {name}: nothing accumulated"


def _errors_rank(rank, world):
    cfg = _cfg(world)
    p = split_global_problem(*make_problem(5, world, T, D, F, E, K, "balanced"), world)[rank]
    msgs = []
    with dm.MoEContext(cfg, device="cpu", main_grad=True) as ctx:
        w13 = p.w13.clone().requires_grad_(True)
        w2 = p.w2.clone().requires_grad_(True)
        cases = [None, torch.zeros_like(w13), torch.zeros(3, dtype=torch.float32),
                 torch.zeros(w13.shape[::-1], dtype=torch.float32).permute(3, 2, 1, 0)]
        for bad in cases:
            w13.main_grad = bad
            w2.main_grad = torch.zeros_like(w2, dtype=torch.float32)
            try:
                ctx(p.x.clone().requires_grad_(True), p.expert_ids, p.scores, w13, w2)
                msgs.append(None)
            except (TypeError, ValueError) as exc:
                msgs.append(f"{type(exc).__name__}: {exc}")
    return msgs


def test_main_grad_errors_name_the_buffer():
    msgs = dm.launch(_errors_rank, 1, timeout=120)[0]
    assert msgs[0].startswith("TypeError: w13.main_grad must be a torch.Tensor"), msgs[0]
    assert msgs[1] == "TypeError: w13.main_grad must be torch.float32, got torch.bfloat16"
    assert msgs[2].startswith("ValueError: w13.main_grad must have w13's shape"), msgs[2]
    assert msgs[3].startswith("ValueError: w13.main_grad must be contiguous"), msgs[3]
    with pytest.raises(ValueError, match="main_grad=True needs a training context"):
        dm.MoEContext(_cfg(1, training=False), device="cpu", main_grad=True)
    with pytest.raises(TypeError, match=r"main_grad must be a bool, got int \(1\)"):
        dm.MoEContext(_cfg(1), device="cpu", main_grad=1)
