"""MXFP8 and block-FP8 training (``MoEConfig(precision="mxfp8" | "fp8_block",
training=True)``, :mod:`distmoe.ops.lowp_train`) on CPU ranks (gloo, the CPU heap, Triton's
interpreter): forward and every gradient against two references.

(a) The recipe in plain PyTorch (:func:`recipe_reference`): the same quantisations by the
    reference quantisers (rows along D, h2 along F, the scored route gradients along D, gh1
    along 2F; weights by ``prepare_weights(reference=True)``), each GEMM exact in float64
    then rounded to fp32 and bf16 where the layer rounds. The two differ only by the fp32
    summation order inside a GEMM (relative 2^-24 per term, far below one bf16 step) until a
    bf16 rounding falls the other way (one bf16 step, 2^-8 of that element); when such an
    element is quantised next, its E4M3 code can move by one step (2^-3 of the element, at
    most 2^-3 of its block's largest value) and that enters one term of a sum over D or F
    (>= 32 terms of similar size at these random inputs). Bound: every output within
    2^-6 of its largest magnitude; a wrong scale, orientation or row gives O(1) errors.
(b) The bf16 layer in float64 (``distmoe.reference.moe_reference``): each quantised operand
    is within 2^-4 of itself (E4M3: 3 fraction bits, round to nearest), two per GEMM, two
    GEMMs chained per output: within 2^-2 of the largest magnitude (a sanity bound; (a) is
    the exact one).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from forward_cases import CASES
from test_mxfp8_forward import executed_routes

import distmoe as dm
from distmoe.kernels.scaled.token_quant import quantize_tokens_ref
from distmoe.ops.lowp import fp8_format
from distmoe.ops.lowp_train import _quantise_weights, fp8_train_configs, train_weights
from distmoe.quant import fp8_block_quantize_ref, mxfp8_quantize_ref, prepare_weights
from distmoe.quant.fp8_block import fp8_block_dequantize, mxfp8_rebase
from distmoe.quant.mxfp8 import mxfp8_dequantize
from distmoe.reference import moe_reference, random_routing, split_global_problem

T, K = 12, 2
TOL_RECIPE = 2.0**-6
TOL_BF16 = 2.0**-2
TOL_NO_GRAD = 2.0**-4
#: (a) on SM90 with 128-wide K groups (fp8_block): the FP8 MMA adds a group's 128 products
#: with a ~13-bit significand, truncating (docs/numerics.md section 6: up to 4 * 33 * 2^-13 of
#: the group's sum of |products| per GEMM, a few percent of the largest output on random
#: data; observed 2^-5.7 in y on an H100, run 66); 32-wide groups (mxfp8) stay within
#: TOL_RECIPE (observed 2^-8.5)
TOL_RECIPE_SM90_128 = 2.0**-4
NAMES = ("y", "grad x", "grad scores", "grad w13", "grad w2")


def _problem(world, E, D, F, seed=58, tokens=T, case=None):
    g = torch.Generator().manual_seed(seed + world)
    x = torch.randn(world * tokens, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    if case is None:
        ids, scores = random_routing(world * tokens, E, K, generator=g, inactive_fraction=0.15)
    else:  # the forward tests' routing cases (tests/ops/forward_cases.py)
        ids, scores = CASES[case](g, world, tokens, E, K)
    gy = torch.randn(world * tokens, D, generator=g).bfloat16()
    return x, ids, scores.float(), w13, w2, gy


def _q(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 values of ``v`` (bf16 rows) quantised along the last dim by the reference
    quantisers in the layer's operand format (``distmoe.ops.lowp.fp8_format``)."""
    if fmt == "fp8_block":
        q, s = fp8_block_quantize_ref(v)
        return fp8_block_dequantize(q, s, dtype=torch.float64)
    q, s = mxfp8_quantize_ref(v, dim=-1)
    if fmt == "mxfp8":
        return mxfp8_dequantize(q, s, dim=-1).double()
    q, s, _ = mxfp8_rebase(q, s)
    return q.double() * torch.exp2(s.double() - 127).repeat_interleave(128, -1)


def _w(q, s, fmt) -> torch.Tensor:
    """float64 values of weight blocks ``q [..., N, K]`` with scales ``s [..., N/B, K/B]``
    (32 x 32 or 128 x 128), rebased onto 128-wide K groups in the ``"mxfp8_rebased"``
    format."""
    if fmt == "fp8_block":
        return fp8_block_dequantize(q, s, dtype=torch.float64)
    g = 32
    if fmt == "mxfp8_rebased":
        q, s, _ = mxfp8_rebase(q, s)
        g = 128
    s = s.repeat_interleave(g, -1).repeat_interleave(32, -2)
    return q.double() * torch.exp2(s.double() - 127)


def _bf(v: torch.Tensor) -> torch.Tensor:
    return v.float().bfloat16()


def _q_tokens(v: torch.Tensor, experts: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 values of the routes' rows ``v [n, C]`` quantised along tokens per expert and
    column (one 128-token block: every expert here has at most 128 rows, so their order in
    the block does not matter), the FP8 weight gradients' operands."""
    out = torch.zeros(v.shape, dtype=torch.float64)
    for ex in experts.unique().tolist():
        sel = experts == ex
        n = int(sel.sum())
        assert n <= 128, "the reference takes one token block per expert"
        block = torch.zeros(128, v.shape[1], dtype=torch.float32)
        block[:n] = v[sel].float()
        q, sc = quantize_tokens_ref(block.T.contiguous(), fmt)  # [C, 128], [C]
        scale = sc.double() if fmt == "fp8_block" else torch.exp2(sc.double() - 127)
        out[sel] = (q.double() * scale[:, None]).T[:n]
    return out


def recipe_reference(x, ids, scores, w13, w2, gy, precision, executed=None,
                     token_wgrad=False):
    """Reference (a): ``[y, grad x, grad scores, grad w13, grad w2]`` of the whole group
    (every route executed). The forward GEMMs read the weight blocks along their K, the
    input-gradient GEMMs the same blocks transposed (rebased along the other axis in the
    ``"mxfp8_rebased"`` format). ``token_wgrad``: the weight gradients' operands quantised
    along tokens (the FP8 WGRAD, :func:`distmoe.plan.rules.fp8_wgrad`): gh3 and h2 for
    grad w2, gh1 and the bf16 x rows for grad w13; else gh3, h2 and gh1 in bf16 with x as
    the forward quantised it."""
    E, _, F, D = w13.shape
    fmt = fp8_format(dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                                  precision=precision))
    precision = fmt  # the activation quantisers' format
    p13, p2 = prepare_weights(w13, w2, "fp8_block" if fmt == "fp8_block" else "mxfp8",
                              reference=True)
    W13 = _w(p13.qdata.view(E, 2 * F, D), p13.scales.flatten(1, 2), fmt)  # [E, 2F, D]
    W2 = _w(p2.qdata, p2.scales, fmt)  # [E, D, F]
    W13d = _w(p13.qdata.view(E, 2 * F, D).mT.contiguous(),
              p13.scales.flatten(1, 2).mT.contiguous(), fmt)  # [E, D, 2F]
    W2d = _w(p2.qdata.mT.contiguous(), p2.scales.mT.contiguous(), fmt)  # [E, F, D]
    N = x.shape[0]
    live = ids >= 0 if executed is None else executed  # routes past the bound: none
    t_idx, k_idx = live.nonzero(as_tuple=True)
    e = ids[t_idx, k_idx]
    s = scores[t_idx, k_idx].double()
    xq = _q(x[t_idx], precision)
    h1 = _bf(torch.einsum("rd,rnd->rn", xq, W13[e]))
    g, u = h1[:, :F].float(), h1[:, F:].float()
    h2 = (torch.nn.functional.silu(g) * u).bfloat16()
    h3 = _bf(torch.einsum("rf,rdf->rd", _q(h2, precision), W2[e]))
    y = torch.zeros(N, D, dtype=torch.float64)
    y.index_add_(0, t_idx, s[:, None] * h3.double())
    gs = torch.zeros(N, K, dtype=torch.float64)
    gs[t_idx, k_idx] = (gy[t_idx].double() * h3.double()).sum(1)
    g3 = (s.float()[:, None] * gy[t_idx].float()).bfloat16()
    gh2 = _bf(torch.einsum("rd,rfd->rf", _q(g3, precision), W2d[e]))
    sg, d = torch.sigmoid(g), gh2.float()
    gh1 = torch.cat([d * u * sg * (1 + g * (1 - sg)), d * g * sg], 1).bfloat16()
    gxr = _bf(torch.einsum("rn,rdn->rd", _q(gh1, precision), W13d[e]))
    gx = torch.zeros(N, D, dtype=torch.float64).index_add_(0, t_idx, gxr.double())
    if token_wgrad:
        wg3, wh2 = _q_tokens(g3, e, fmt), _q_tokens(h2, e, fmt)
        wgh1, wx = _q_tokens(gh1, e, fmt), _q_tokens(x[t_idx], e, fmt)
    else:
        wg3, wh2, wgh1, wx = g3.double(), h2.double(), gh1.double(), xq
    gw2 = torch.zeros(E, D, F, dtype=torch.float64)
    gw2.index_add_(0, e, wg3[:, :, None] * wh2[:, None, :])
    gw13 = torch.zeros(E, 2 * F, D, dtype=torch.float64)
    gw13.index_add_(0, e, wgh1[:, :, None] * wx[:, None, :])
    return [y, gx, gs, gw13.view(E, 2, F, D), gw2]


def _rank(rank, world, E, D, F, precision, main_grad=False, device="cpu", tokens=T,
          transport="auto", case=None, factor=None, row_block=16, fp8_wgrad=False):
    x, ids, scores, w13, w2, gy = _problem(world, E, D, F, tokens=tokens, case=case)
    mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
    dev = torch.device(device)
    mine = dataclasses.replace(mine, **{f.name: getattr(mine, f.name).to(dev)
                                        for f in dataclasses.fields(mine)})
    gy = gy[rank * tokens:(rank + 1) * tokens].to(dev)
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=tokens,
                       row_block=row_block, precision=precision, training=True,
                       device_scratch_factor=float(world if factor is None else factor))
    check = factor is None or factor >= world  # check mode refuses routes past the bound
    leaves = [t.clone().requires_grad_(True) for t in (mine.x, mine.scores, mine.w13, mine.w2)]
    if main_grad:
        for w in leaves[2:]:
            w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device=dev)
    out = {}
    with dm.MoEContext(cfg, device=dev, main_grad=main_grad, check=check,
                       transport=transport) as ctx:
        if fp8_wgrad:  # the FP8 weight gradients (not the plan's choice: rules.PICK_FP8_WGRAD)
            ctx._lowp_train = fp8_train_configs(cfg, dev, fp8_wgrad=True)
        out["explain"] = ctx.explain()
        out["fp8_wgrad"] = ctx._lowp_train.w13_wgrad is not None
        out["bound"] = ctx.receive_bound
        y = ctx(leaves[0], mine.expert_ids, leaves[1], leaves[2], leaves[3])
        (y.float() * gy.float()).sum().backward()
        grads = [t.grad.clone() for t in leaves[:2]]  # later backwards add into .grad
        grads += ([w.main_grad - 0.5 for w in leaves[2:]] if main_grad else
                  [t.grad.clone() for t in leaves[2:]])
        out["layer"] = [y.detach()] + grads
        # a call without autograd on the same weights: the inference forward, whose W13
        # epilogue applies SwiGLU to the fp32 accumulators (no bf16 h1): its h2 is within a
        # bf16 step or two of the training forward's, which moves the E4M3 code of the h2
        # values near a rounding boundary (a few percent of them) by one step (2^-3 of the
        # value): bound TOL_NO_GRAD
        with torch.no_grad():
            out["no_grad"] = ctx(mine.x, mine.expert_ids, mine.scores, leaves[2], leaves[3])
        cached = train_weights(ctx, leaves[2], leaves[3])
        y2 = ctx(leaves[0], mine.expert_ids, leaves[1], leaves[2], leaves[3])
        out["cache_kept"] = train_weights(ctx, leaves[2], leaves[3]) is cached
        out["repeat"] = torch.equal(y2.detach().view(torch.int16), y.detach().view(torch.int16))
        y2.sum().backward()  # every rank runs the backward of every call
        before = [t.clone() for t in (cached.w2_q, cached.w2_s, cached.w2t_s)]
        address = cached.w2_s.data_ptr()
        with torch.no_grad():
            leaves[3].mul_(0.5)  # an optimizer step: a new weight version
        y3 = ctx(leaves[0], mine.expert_ids, leaves[1], leaves[2], leaves[3])
        # quantised again into the same tensors (their addresses kept for CUDA graphs)
        again = train_weights(ctx, leaves[2], leaves[3])
        fresh = _quantise_weights(ctx, leaves[2], leaves[3])
        out["cache_renewed"] = (
            again is cached and again.w2_s.data_ptr() == address
            and not torch.equal(again.w2_s, before[1])  # halved weights: new scales
            and all(torch.equal(getattr(again, n).view(torch.uint8),
                                getattr(fresh, n).view(torch.uint8))
                    for n in ("w13_q", "w13_s", "w2_q", "w2_s", "w2t_q", "w2t_s", "w13t_q",
                              "w13t_s")))
        with torch.no_grad():
            leaves[2].mul_(2.0)
        try:
            y3.sum().backward()
        except RuntimeError as exc:
            out["in_place"] = str(exc)
        # a copy (a new tensor, maybe at a freed one's address) is never taken for the weight
        out["copy_missed"] = train_weights(ctx, leaves[2].detach().clone(), leaves[3]) \
            is not cached
        ctx.reset_slots()
    return {k: ([t.cpu() for t in v] if isinstance(v, list) else
                v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _check(per_rank, world, E, D, F, precision, tokens=T, tol_recipe=TOL_RECIPE, case=None):
    x, ids, scores, w13, w2, gy = _problem(world, E, D, F, tokens=tokens, case=case)
    executed = executed_routes(ids, world, E, per_rank[0]["bound"])
    recipe = recipe_reference(x, ids, scores, w13, w2, gy, precision, executed,
                              token_wgrad=per_rank[0]["fp8_wgrad"])
    leaves = [t.double().requires_grad_(True) for t in (x, scores, w13, w2)]
    # the bf16 layer in float64 on the executed routes (a dropped route contributes nothing
    # and gets zero gradients)
    y64 = moe_reference(leaves[0], torch.where(executed, ids, -1), leaves[1], leaves[2],
                        leaves[3])
    (y64 * gy.double()).sum().backward()
    bf16 = [y64] + [t.grad for t in leaves]
    e_local = E // world
    worst = {}
    for r, out in enumerate(per_rank):
        tok = slice(r * tokens, (r + 1) * tokens)
        exp = slice(r * e_local, (r + 1) * e_local)
        for i, (name, got) in enumerate(zip(NAMES, out["layer"], strict=True)):
            part = exp if i >= 3 else tok
            for label, ref, tol in (("recipe", recipe[i][part], tol_recipe),
                                    ("bf16 float64", bf16[i][part], TOL_BF16)):
                scale = ref.abs().max().item()
                err = (got.double() - ref).abs().max().item()
                assert err <= tol * scale, (f"rank {r} {name}: {err:.3g} from the {label} "
                                            f"reference (bound {tol} x {scale:.3g})")
                worst[(label, name)] = max(worst.get((label, name), 0),
                                           err / scale if scale else err)
        y = out["layer"][0]
        diff = (out["no_grad"].double() - y.double()).abs().max().item()
        assert diff <= TOL_NO_GRAD * y.abs().max().item(), f"rank {r}: no-grad call {diff:.3g}"
        assert out["repeat"], f"rank {r}: a second call gave other bits"
        assert f"precision: {precision}, operand format" in out["explain"], out["explain"]
        assert "w13 dgrad" in out["explain"]
        assert out["cache_kept"], f"rank {r}: unchanged weights were quantised again"
        assert out["copy_missed"], f"rank {r}: a copy of a weight took its cached form"
        assert out["cache_renewed"], (f"rank {r}: a changed weight kept its old quantised "
                                      "form, or got it in new tensors")
        assert "w13 was modified in place" in out.get("in_place", ""), out.get("in_place")
    return worst


@pytest.mark.parametrize("world", [1, 2])
def test_mxfp8_training_against_both_references(world):
    E, D, F = 4, 64, 32
    per_rank = dm.launch(_rank, world, args=(E, D, F, "mxfp8"), timeout=300)
    _check(per_rank, world, E, D, F, "mxfp8")


@pytest.mark.parametrize("case,factor", [("all_to_one_expert", None),
                                         ("zero_live_tokens_on_last_rank", None),
                                         ("imbalance_8x", 0.5)])
def test_mxfp8_training_routing_cases(case, factor):
    """EP 2: every route on one expert, a rank whose tokens route nowhere, and a skew past
    the receive bound (half the routes' rows: the routes past it are dropped, counted, and
    get zero gradients); the same references on the executed routes."""
    E, D, F = 4, 64, 32
    per_rank = dm.launch(_rank, 2, args=(E, D, F, "mxfp8", False, "cpu", T, "auto", case,
                                         factor), timeout=300)
    if factor is not None:
        x, ids, *_ = _problem(2, E, D, F, case=case)
        dropped = (ids >= 0).sum() - executed_routes(ids, 2, E, per_rank[0]["bound"]).sum()
        assert dropped > 0, "the case must exceed the receive bound"
    _check(per_rank, 2, E, D, F, "mxfp8", case=case)


def test_mxfp8_training_over_the_nccl_transport():
    """``transport="nccl"`` (gloo standing in for NCCL): the collectives around a one-rank
    MXFP8 training context per rank, the same bounds."""
    E, D, F = 4, 64, 32
    per_rank = dm.launch(_rank, 2, args=(E, D, F, "mxfp8", False, "cpu", T, "nccl"),
                         timeout=300)
    _check(per_rank, 2, E, D, F, "mxfp8")


def test_mxfp8_rebased_training_against_both_references():
    """D and F multiples of 128: the mxfp8 layer runs its operands rebased onto 128-wide K
    groups (``distmoe.plan.rules.mxfp8_k_group``); the recipe rebases alike. Row blocks of
    128 with the FP8 weight gradients asked for: on operands quantised along tokens."""
    E, D, F = 2, 128, 128
    per_rank = dm.launch(_rank, 1, args=(E, D, F, "mxfp8", False, "cpu", T, "auto", None,
                                         None, 128, True), timeout=300)
    assert per_rank[0]["fp8_wgrad"]
    _check(per_rank, 1, E, D, F, "mxfp8")


@pytest.mark.parametrize("row_block,main_grad", [(16, False), (128, True)])
def test_fp8_block_training_against_both_references(row_block, main_grad):
    """Row blocks of 16: bf16 weight gradients; of 128 with the FP8 weight gradients asked
    for: on operands quantised along tokens, added in fp32 into ``main_grad``."""
    E, D, F = 2, 128, 128
    per_rank = dm.launch(_rank, 1, args=(E, D, F, "fp8_block", main_grad, "cpu", T, "auto",
                                         None, None, row_block, True), timeout=300)
    assert per_rank[0]["fp8_wgrad"] == (row_block == 128)
    _check(per_rank, 1, E, D, F, "fp8_block")


def test_mxfp8_training_main_grad():
    """``main_grad=True``: the weight gradients added in fp32 into ``main_grad`` (starting
    at 0.5 here), the same values within the bounds."""
    E, D, F = 4, 64, 32
    per_rank = dm.launch(_rank, 1, args=(E, D, F, "mxfp8", True), timeout=300)
    _check(per_rank, 1, E, D, F, "mxfp8")


@pytest.mark.gpu
@pytest.mark.parametrize("precision,F", [("mxfp8", 224), ("mxfp8", 128), ("fp8_block", 128)])
def test_fp8_training_gpu(precision, F):
    """One GPU (EP = 1, T = 256, D = 256, E = 8; F = 224 keeps exact MXFP8, F = 128 rebases
    it onto 128-wide groups, whose layer also takes FP8 weight gradients): the same
    references; the recipe bound of 128-wide groups widened for the SM90 FP8 MMA's
    accumulation (``TOL_RECIPE_SM90_128``)."""
    E, D, tokens = 8, 256, 256
    wide = fp8_format(dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=tokens,
                                   precision=precision)) != "mxfp8"
    # 128-wide groups with row blocks of 128: the FP8 weight gradients (Gluon on Hopper)
    out = _rank(0, 1, E, D, F, precision, device="cuda", tokens=tokens,
                row_block=128 if wide else 16, fp8_wgrad=wide)
    assert out["fp8_wgrad"] == wide
    worst = _check([out], 1, E, D, F, precision, tokens=tokens,
                   tol_recipe=TOL_RECIPE_SM90_128 if wide else TOL_RECIPE)
    print(precision, {f"{a} {b}": f"{v:.2e}" for (a, b), v in worst.items()})


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_fp8_training_contexts_allocate_no_slots(precision):
    """An FP8 training context's layers keep their state in per-call tensors: its activation
    buffer is the plan's scratch alone (no slots left empty), a bf16 one the whole plan."""
    cfg = dm.MoEConfig(hidden=64, ffn=32, num_experts=4, top_k=2, max_tokens=16,
                       training=True, precision=precision, max_layers_per_slot=2)
    plan = dm.plan_memory(cfg, 1)
    with dm.MoEContext(cfg, device="cpu") as ctx:
        acts = ctx.activations
        if precision == "bf16":
            assert acts.slot_bytes == plan.slot_capacity_bytes > 0
            assert acts.storage.numel() == plan.activation_buffer_bytes
        else:
            assert acts.slot_bytes == 0 and acts.storage.numel() == plan.scratch_bytes
            assert ctx.stats()["activations"]["slot_capacity_bytes"] == 0
