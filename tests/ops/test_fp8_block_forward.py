"""Block-FP8 inference forward (``MoEConfig(precision="fp8_block", training=False)``; DeepSeek-
V3's recipe: float32 scales per 1 x 128 activation block and 128 x 128 weight block) on CPU
ranks (Triton interpreter), EP 1 and 2, against the bf16 layer in float64 with the bound of
``test_mxfp8_forward.reference_b`` for block FP8 (each operand's quantisation error carried
through both GEMMs, the kernels' fp32 summation over 128-wide steps, every bf16 rounding).
Also: weights loaded as a checkpoint stores them (``PreparedWeight.fp8_block``) give the
bits of ``prepare_weights``; a second call gives the same bits; the refusals.
"""

from __future__ import annotations

import pytest
import torch
from test_mxfp8_forward import _problem, executed_routes, reference_b

import distmoe as dm
from distmoe.quant import PreparedWeight, fp8_block_quantize_weight, prepare_weights
from distmoe.reference import split_global_problem

D, F, T, K = 128, 256, 16, 2
CASES = {"balanced": 1.0, "inactive_mix": 1.0, "all_to_one_expert": 0.25}


def _rank(rank, world, seed, E, factors, device="cpu"):
    dev = torch.device(device) if device == "cpu" else torch.device(
        "cuda", torch.cuda.current_device())
    out = []
    for case in CASES:
        x, ids, scores, w13, w2 = _problem(seed, world, T, E, K, case, (D, F))
        mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
        w13p, w2p = prepare_weights(mine.w13.to(dev), mine.w2.to(dev), "fp8_block")
        # the same weights as a checkpoint stores them: e4m3 + weight_scale_inv
        w13c = PreparedWeight.fp8_block(*fp8_block_quantize_weight(mine.w13.to(dev)))
        cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                           precision="fp8_block", training=False, row_block=16,
                           device_scratch_factor=factors[case])
        with dm.MoEContext(cfg, device=dev, check=factors[case] >= world) as ctx:
            args = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores)]
            y = ctx(*args, w13p, w2p)
            y2 = ctx(*args, w13c, w2p)
            out.append((y.cpu(), torch.equal(y.view(torch.int16), y2.view(torch.int16))))
    return out


def _check(per_rank, EP, E, seed, factors, tc_rel=0.0):
    for i, case in enumerate(CASES):
        y = torch.cat([per_rank[r][i][0] for r in range(EP)])
        assert all(per_rank[r][i][1] for r in range(EP)), f"{case}: checkpoint path differs"
        x, ids, scores, w13, w2 = _problem(seed, EP, T, E, K, case, (D, F))
        cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                           precision="fp8_block", training=False, row_block=16,
                           device_scratch_factor=factors[case])
        bound_rows = dm.plan_memory(cfg, EP).device_receive_bound
        executed = executed_routes(ids, EP, E, bound_rows)
        y64, bound = reference_b(x, ids, scores, w13, w2, executed, tc_rel,
                                 precision="fp8_block")
        err = (y.double() - y64).abs()
        assert (err <= bound).all(), (f"{case}: error {err.max():.3g} above its bound at "
                                      f"{(err > bound).nonzero()[0].tolist()}")
        assert (err > 0).any() or case == "all_to_one_expert", "no quantisation error at all"


@pytest.mark.parametrize("EP, E", [(1, 4), (2, 4)])
def test_fp8_block_forward_against_bf16_reference(EP, E):
    seed = 128 + EP
    factors = {c: f * EP for c, f in CASES.items()}
    _check(dm.launch(_rank, EP, args=(seed, E, factors)), EP, E, seed, factors)


def test_refusals():
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=K, max_tokens=T,
                       precision="fp8_block", training=False, row_block=16)
    with pytest.raises(ValueError, match=r"hidden \(96\) must be a multiple of 128 for "
                                         r"precision 'fp8_block'"):
        dm.MoEConfig(hidden=96, ffn=F, num_experts=4, top_k=K, max_tokens=T,
                     precision="fp8_block", training=False)
    with pytest.raises(ValueError, match=r"precision 'fp8_block' with training=True"):
        dm.MoEContext(dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=K, max_tokens=T,
                                   precision="fp8_block"), group="local")
    w13 = torch.randn(4, 2, F, D)
    w2 = torch.randn(4, D, F)
    w13m, w2m = prepare_weights(w13, w2, "mxfp8")
    with dm.MoEContext(cfg, device="cpu") as ctx:
        x = torch.randn(T, D).bfloat16()
        ids = torch.zeros(T, K, dtype=torch.int64)
        scores = torch.ones(T, K)
        with pytest.raises(ValueError, match=r"w13 was prepared for precision 'mxfp8', the "
                                             r"context runs 'fp8_block'"):
            ctx(x, ids, scores, w13m, w2m)
        with pytest.raises(TypeError, match=r"w13 must be a PreparedWeight for precision "
                                            r"'fp8_block'.*prepare_weights"):
            ctx(x, ids, scores, w13.bfloat16(), w2.bfloat16())
    with pytest.raises(ValueError, match=r"scales must be float32 of shape \[4, 2, 2, 1\]"):
        PreparedWeight.fp8_block(w13.to(torch.float8_e4m3fn), torch.ones(4, 2, 2, 2))


@pytest.mark.gpu
def test_fp8_block_forward_gpu():
    EP, E, seed = 1, 4, 7
    factors = {c: f * EP for c, f in CASES.items()}
    per_rank = dm.launch(_rank, EP, device="cuda", gpus=[0], args=(seed, E, factors, "cuda"))
    # SM90's FP8 MMA accumulation (the model of test_mxfp8_forward: 13 fraction bits, for
    # each of a step's 32-deep MMAs)
    _check(per_rank, EP, E, seed, factors, tc_rel=4 * 33 * 2.0**-13)
