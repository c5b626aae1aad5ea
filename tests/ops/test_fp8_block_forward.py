"""Block-FP8 inference forward (``MoEConfig(precision="fp8_block", training=False)``; DeepSeek-
V3's recipe: float32 scales per 1 x 128 activation block and 128 x 128 weight block) on CPU
ranks (Triton interpreter), EP 1 and 2, against two references:

(a) the same block-FP8 arithmetic in plain PyTorch (:func:`reference_a`: the rows and h2
    quantised by the reference quantiser, the prepared weights dequantised), with a bound
    carried stage by stage (its docstring); this is the tight check;
(b) the bf16 layer in float64 with ``test_mxfp8_forward.reference_b``'s worst-case bound for
    block FP8 (each operand's quantisation error carried through both GEMMs); at these
    widths it is far above the error (about 100 x the outputs): it guards gross errors only.

Also: weights loaded as a checkpoint stores them (``PreparedWeight.fp8_block``) give the
bits of ``prepare_weights``; a second call gives the same bits; the refusals.
"""

from __future__ import annotations

import pytest
import torch
from test_mxfp8_forward import (
    U,
    _problem,
    _routes,
    combine_ref,
    executed_routes,
    reference_b,
    w2_routes,
    w13_swiglu_interval,
)

import distmoe as dm
from distmoe.quant import (
    PreparedWeight,
    fp8_block_dequantize,
    fp8_block_quantize_ref,
    fp8_block_quantize_weight,
    prepare_weights,
)
from distmoe.quant.formats import round_minifloat_ref
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


def _block_max(t):
    """Per element of t [R, W], the largest |t| of its 1 x 128 block."""
    return t.abs().unflatten(-1, (-1, 128)).amax(-1).repeat_interleave(128, -1)


def _quantize_at(v, s32):
    """Block-FP8 quantised values of float64 bf16-valued ``v`` at float32 scales ``s32`` (per
    element), as the quantiser computes them: ``v / s`` in float32, rounded to E4M3 (nearest
    even, saturated at 448), times ``s``. Monotone in v for a fixed scale."""
    y = (v.float() / s32).double()
    return round_minifloat_ref(y, 3, -6, 448.0) * s32.double()


def reference_a(x, ids, scores, w13p, w2p, executed, tc_rel=0.0):
    """(y, bound): the block-FP8 layer in plain PyTorch and, per element, a bound on
    |kernel - reference|. Both start from the same bits (the gathered rows are x's rows, the
    row quantiser is the kernel's bits, tests/kernels/scaled; the prepared weights are
    shared). Per stage (S = sum of |a b| over a dot, dequantised operands, u = 2^-24,
    ``tc_rel`` the SM90 tensor-core term, 0 on the CPU):

    * W13 accumulators: kernel within (127 + D/128 + 3) u S of exact (docs/numerics.md, 128-wide
      K groups), reference (float64 rounded once to fp32) within u S;
    * SwiGLU in fp32 as in test_mxfp8_forward.reference_a, then bf16: the kernel's h2 lies in
      [rn(f - e), rn(f + e)];
    * h2 quantisation along F: where every element of a 1 x 128 block has the same largest
      possible and smallest possible block amax (the kernel's block amax is then known, so
      its scale is the reference's), the kernel's value lies in [Q(lo), Q(hi)] (monotone at
      a fixed scale); elsewhere |h2 difference| plus both quantisation errors (2^-4 |v| +
      2^-10 s each);
    * W2: |W2| @ dq + (127 + F/128 + 4) u S_2 + tc_rel S_2, then one bf16 ulp;
    * combine: test_mxfp8_forward.combine_ref.
    """
    D_, F_ = x.shape[1], w2p.shape[2]
    n, k, e, s = _routes(ids, scores, executed)
    xq, xs = fp8_block_quantize_ref(x[n])
    xr = fp8_block_dequantize(xq, xs, dtype=torch.float64)
    w13 = w13p.dequantize(torch.float64)  # [E, 2, F, D]
    w2 = w2p.dequantize(torch.float64)  # [E, D, F]
    h2, lo, hi, amin, amax = w13_swiglu_interval(xr, w13, e,
                                                 (127 + D_ // 128 + 4) * U + tc_rel)
    q_ref, s_ref = fp8_block_quantize_ref(h2)
    h2q = fp8_block_dequantize(q_ref, s_ref, dtype=torch.float64)
    blk_lo, blk_hi = _block_max(amin), _block_max(amax)
    s32 = torch.where(blk_hi > 0, blk_hi.float() / 448.0, 1.0)
    dq_same = torch.maximum(_quantize_at(hi, s32) - h2q, h2q - _quantize_at(lo, s32))
    dq_other = (hi - lo) + 2 * (2.0**-4 * amax + 2.0**-10 * blk_hi / 448.0) * (1 + 2.0**-20)
    dq = torch.where(blk_lo == blk_hi, dq_same, dq_other)
    h3, dh3 = w2_routes(h2q, dq, w2, e, (127 + F_ // 128 + 4) * U + tc_rel)
    return combine_ref(x.shape[0], ids.shape[1], n, k, s, h3, dh3)


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
        # 128 x 128 blocks never straddle two experts: all experts at once give each rank's
        w13p, w2p = prepare_weights(w13, w2, "fp8_block")
        y_a, bound_a = reference_a(x, ids, scores, w13p, w2p, executed, tc_rel)
        err_a = (y.double() - y_a.double()).abs()
        assert (err_a <= bound_a).all(), (
            f"{case}: (a) error {err_a.max():.3g} above its bound at "
            f"{(err_a > bound_a).nonzero()[0].tolist()}")
        y64, bound = reference_b(x, ids, scores, w13, w2, executed, tc_rel,
                                 precision="fp8_block")
        err = (y.double() - y64).abs()
        assert (err <= bound).all(), (f"{case}: (b) error {err.max():.3g} above its bound at "
                                      f"{(err > bound).nonzero()[0].tolist()}")
        assert (err > 0).any(), f"{case}: no quantisation error at all"
        idle = ~executed.any(1)
        assert torch.equal(y[idle], torch.zeros_like(y[idle])), f"{case}: idle tokens"


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
    w13 = torch.randn(4, 2, F, D)
    w2 = torch.randn(4, D, F)
    w13m, w2m = prepare_weights(w13, w2, "mxfp8")
    train = dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=K, max_tokens=T,
                         precision="fp8_block", training=True, row_block=16)
    with dm.MoEContext(train, device="cpu") as ctx:  # takes the parameters, not prepared ones
        w13b, w2b = prepare_weights(w13, w2, "fp8_block")
        with pytest.raises(TypeError, match=r"w13 must be the layer's weight tensor in a "
                                            r"fp8_block training context.*training=False"):
            ctx(torch.randn(T, D).bfloat16(), torch.zeros(T, K, dtype=torch.int64),
                torch.ones(T, K), w13b, w2b)
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
