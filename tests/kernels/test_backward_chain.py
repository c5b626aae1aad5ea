"""The backward kernels chained on one small problem against autograd of the fp64 reference layer, and both DGRADs on fewer tiles than programs.

Layouts, poisoning and tolerances: :mod:`backward_cases` (tests/kernels/backward_cases.py).
"""

import math

import pytest
import torch
from backward_cases import (
    DEVICE,
    act_rows,
    build_layout,
    layout_from_counts,
    make_ids,
    poisoned,
    row_table,
    same_bits,
)

from distmoe.kernels.movement.route_grad import push_route_grads, reduce_routes, route_grads
from distmoe.kernels.w2_dgrad.config import W2DgradConfig
from distmoe.kernels.w2_dgrad.triton import w2_dgrad_swiglu_bwd
from distmoe.kernels.w13_dgrad.config import W13DgradConfig
from distmoe.kernels.w13_dgrad.triton import w13_dgrad_scatter
from distmoe.kernels.wgrad.config import WgradConfig
from distmoe.kernels.wgrad.triton import w2_wgrad, w13_wgrad
from distmoe.plan import rules
from distmoe.reference import moe_reference


@pytest.mark.parametrize("counts", [[0, 0, 0], [0, 5, 0]], ids=["no_live_tile", "two_tiles"])
def test_dgrad_persistent_few_tiles(counts):
    """Fewer live tiles than persistent programs (none, or 2 of the interpreter's 3): programs
    without a tile exit at once; the outputs equal the tile grid's bit for bit (poison kept)."""
    hidden, ffn, block_m = 48, 40, 16  # two column tiles of 32 in both kernels
    layout = layout_from_counts(counts, block_m)
    num_act = layout.num_act
    combine = torch.randn(max(sum(counts), 1), hidden, device=DEVICE).bfloat16()
    ptrs = row_table(layout, combine)
    w2 = (torch.randn(3, hidden, ffn, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    h1 = torch.randn(num_act, 2 * ffn, device=DEVICE).bfloat16()
    h1[~layout.live_act()] = float("nan")
    w13 = (torch.randn(3, 2, ffn, hidden, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    outs = {}
    for persistent in (False, True):
        cfg = dict(block_m=block_m, block_n=32, block_k=32, num_warps=4, persistent=persistent)
        grad_h1, h2, grad_h3 = (poisoned(num_act, w) for w in (2 * ffn, ffn, hidden))
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                            h2_out=h2, grad_h3_out=grad_h3, config=W2DgradConfig(**cfg))
        dispatch = poisoned(max(sum(counts), 1), hidden)
        w13_dgrad_scatter(h1, layout.padded_offsets, layout.row_offsets, w13,
                          row_table(layout, dispatch), config=W13DgradConfig(**cfg))
        outs[persistent] = (grad_h1, h2, grad_h3, dispatch)
    for got, want in zip(outs[True], outs[False], strict=True):
        assert same_bits(got, want)
    if sum(counts) == 0:  # nothing written at all
        for out in outs[True]:
            assert out.isnan().all()
    else:
        assert not outs[True][3].isnan().any()  # every route row written


def _run_chain(x, ids, scores, w13, w2, grad_y, *, block_m, configs, t_max, offsets,
               scored=False):
    """Saved forward state from the fp64 reference rounded to bf16 (what the forward kernels
    keep), then the six backward kernels in order. ``offsets``: the saved state in one 1-D
    slot at device-side offsets (h1_offset with grad_h1 in place, x_offset) and h3 read in
    place from the combine buffer (h3_addr); else plain tensors. ``scored``: the layer's
    order instead (push_route_grads, the W2 DGRAD computing the score gradients into the
    combine rows, reduce_routes summing them; no h3 read). Returns (grad_x, grad_scores,
    grad_w13, grad_w2 increments)."""
    num_tokens, top_k = ids.shape
    num_experts, _, ffn, hidden = w13.shape
    layout = build_layout(ids.cpu(), num_experts, block_m, extra_tiles={0: 1})
    rows = layout.row_offsets.tolist()
    num_act = layout.num_act

    # Forward state in activation rows: x_gathered, h1 (bf16), h3 per route slot (bf16).
    x_gathered = act_rows(layout, x, top_k=top_k)
    h1_exact = torch.zeros(num_act, 2 * ffn, dtype=torch.float64, device=DEVICE)
    h3_exact = torch.zeros(num_act, hidden, dtype=torch.float64, device=DEVICE)
    for e in range(num_experts):
        r = slice(rows[e], rows[e + 1])
        h1_exact[r] = x_gathered[r].double() @ w13[e].double().reshape(2 * ffn, hidden).t()
        g, u = h1_exact[r, :ffn], h1_exact[r, ffn:]
        h3_exact[r] = (torch.nn.functional.silu(g) * u) @ w2[e].double().t()
    live = layout.live_act()
    h1 = h1_exact.bfloat16()
    h1[~live] = float("nan")
    route_of_act = layout.route_of_act.to(DEVICE)
    h3_routes = poisoned(t_max * top_k, hidden)
    h3_routes[route_of_act[live]] = h3_exact[live].bfloat16()

    # Owner buffers (combine / dispatch) and outputs, poisoned.
    combine = poisoned(t_max * top_k, hidden)
    dispatch = poisoned(t_max * top_k, hidden)
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    grad_x = poisoned(num_tokens, hidden)
    grad_h3 = poisoned(num_act, hidden)
    h2 = poisoned(num_act, ffn)
    grad_w2_before = torch.randn(num_experts, hidden, ffn, device=DEVICE)
    grad_w13_before = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    grad_w2, grad_w13 = grad_w2_before.clone(), grad_w13_before.clone()

    score_parts = None
    if scored:
        # Every route's activation row (the push's destination), one rank.
        dest_rows = torch.full((num_tokens * top_k,), -1, dtype=torch.int32, device=DEVICE)
        dest_rows[route_of_act[live]] = torch.arange(num_act, device=DEVICE)[live].int()
        push_route_grads(grad_y, ids, scores, combine,
                         dest_rows=dest_rows.reshape(num_tokens, top_k),
                         dest_bases=torch.tensor([grad_h3.data_ptr()], device=DEVICE),
                         experts_per_rank=num_experts)
        score_parts = -(-ffn // configs["w2_dgrad"].block_n)
    if offsets:
        # One slot: [8 lead elements | x_gathered rows | h1 rows], offsets on the device.
        x_off, h1_off = 8, 8 + num_act * hidden
        slot = poisoned(h1_off + num_act * 2 * ffn)
        slot[x_off:h1_off] = x_gathered.reshape(-1)
        slot[h1_off:] = h1.reshape(-1)
        x_offset = torch.tensor([x_off], dtype=torch.int64, device=DEVICE)
        h1_offset = torch.tensor([h1_off], dtype=torch.int64, device=DEVICE)
        grad_h1 = slot[h1_off:].view(num_act, 2 * ffn)  # in place over the h1 rows
        if not scored:
            combine.copy_(h3_routes)  # the combine buffer still holds the routes' results
            h3_addr = torch.tensor([combine.data_ptr()], dtype=torch.int64, device=DEVICE)
            route_grads(grad_y, None, ids, scores, combine, grad_scores, h3_addr=h3_addr)
        h1_arg, x_arg = slot, slot
    else:
        x_offset = h1_offset = None
        grad_h1 = h1  # in place
        if not scored:
            route_grads(grad_y, h3_routes, ids, scores, combine, grad_scores)
        h1_arg, x_arg = h1, x_gathered
    w2_dgrad_swiglu_bwd(
        row_table(layout, combine),
        layout.padded_offsets,
        layout.row_offsets,
        w2,
        h1_arg,
        grad_h1,
        h1_offset=h1_offset,
        h2_out=h2,
        grad_h3_out=None if scored else grad_h3,
        grad_h3_rows=grad_h3 if scored else None,
        scored_rows=scored,
        config=configs["w2_dgrad"],
    )
    w2_wgrad(
        grad_h3,
        h2,
        layout.padded_offsets,
        layout.row_offsets,
        grad_w2,
        config=configs["w2_wgrad"],
    )
    w13_dgrad_scatter(
        grad_h1,
        layout.padded_offsets,
        layout.row_offsets,
        w13,
        row_table(layout, dispatch),
        config=configs["w13_dgrad"],
    )
    w13_wgrad(
        grad_h1,
        x_arg,
        layout.padded_offsets,
        layout.row_offsets,
        grad_w13,
        x_offset=x_offset,
        config=configs["w13_wgrad"],
    )
    if scored:
        reduce_routes(dispatch, ids, grad_x, score_rows=combine, score_parts=score_parts,
                      grad_scores_out=grad_scores)
    else:
        reduce_routes(dispatch, ids, grad_x)
    return grad_x, grad_scores, grad_w13 - grad_w13_before, grad_w2 - grad_w2_before


def _autograd_grads(x, ids, scores, w13, w2, grad_y, dtype):
    leaves = [
        x.to(dtype),
        scores.to(torch.float64 if dtype == torch.float64 else torch.float32),
        w13.to(dtype),
        w2.to(dtype),
    ]
    leaves = [t.detach().requires_grad_() for t in leaves]
    y = moe_reference(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y.backward(grad_y.to(y.dtype))
    return [t.grad.double().cpu() for t in leaves]


def _chain_check(
    num_tokens, top_k, num_experts, experts, hidden, ffn, block_m, configs, *, offsets=False,
    scored=False,
):
    t_max = num_tokens + 2
    x = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    ids = make_ids(num_tokens, top_k, experts).to(DEVICE)
    scores = torch.rand(num_tokens, top_k, device=DEVICE) * (ids >= 0)
    w13 = (torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    grad_y = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()

    ours = _run_chain(
        x,
        ids,
        scores,
        w13,
        w2,
        grad_y,
        block_m=block_m,
        configs=configs,
        t_max=t_max,
        offsets=offsets,
        scored=scored,
    )
    exact = _autograd_grads(x, ids, scores, w13, w2, grad_y, torch.float64)
    torch_bf16 = _autograd_grads(x, ids, scores, w13, w2, grad_y, torch.bfloat16)
    names = ("grad_x", "grad_scores", "grad_w13", "grad_w2")
    for name, got, ref, base in zip(names, ours, exact, torch_bf16, strict=True):
        got = got.double().cpu()
        assert torch.isfinite(got).all(), f"{name} holds NaN/inf"
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item() / scale
        base_err = (base - ref).abs().max().item() / scale
        # The rule of the suite: at most 2x the error of torch autograd in bf16 (same bf16
        # saved state and gradients, fp32 scores); 2e-3 of the largest value floors it for
        # outputs where torch's bf16 path happens to be nearly exact (a handful of bf16
        # roundings of relative 2^-9 each, chained).
        assert err <= max(2 * base_err, 2e-3), f"{name}: error {err:.2e}, torch bf16 {base_err:.2e}"
    assert (ours[0][0] == 0).all()  # token 0 has no active route: exact zeros


@pytest.mark.parametrize("scored", [False, True], ids=["owner_scores", "expert_scores"])
@pytest.mark.parametrize("offsets", [False, True])
def test_backward_chain(offsets, scored):
    block_m = 16
    configs = {
        # scored: two column tiles of F, two score parts per route
        "w2_dgrad": W2DgradConfig(block_m=block_m, block_n=16 if scored else 32, block_k=32,
                                  num_warps=4),
        "w2_wgrad": WgradConfig(
            block_m=block_m, block_k=16, block_out_m=32, block_out_n=32, num_warps=4
        ),
        "w13_dgrad": W13DgradConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4),
        "w13_wgrad": WgradConfig(
            block_m=block_m, block_k=16, block_out_m=32, block_out_n=32, num_warps=4
        ),
    }
    # Expert 3 receives no rows; inactive routes; T not a multiple of the row block.
    _chain_check(
        num_tokens=13,
        top_k=3,
        num_experts=4,
        experts=[0, 1, 2],
        hidden=64,
        ffn=32,
        block_m=block_m,
        configs=configs,
        offsets=offsets,
        scored=scored,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("scored", [False, True], ids=["owner_scores", "expert_scores"])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("hint", [None, 2048], ids=["no_hint", "layer_hint"])
def test_backward_chain_gpu_default_configs(offsets, hint, scored):
    # Production tiles (block_m 128, 8 warps, TMA, pipelined row loops). With the layer's
    # shape hint: the tuned 128 x 256 DGRAD tiles (F = 384: a half-empty last tile), the
    # persistent W13 DGRAD grid and 128 x 256 WGRAD tiles.
    configs = {
        "w2_dgrad": rules.w2_dgrad_config(hidden=512, ffn=384, rows_per_expert=hint),
        "w2_wgrad": rules.wgrad_config(out_rows=512, out_cols=384, rows_per_expert=hint),
        "w13_dgrad": rules.w13_dgrad_config(hidden=512, ffn=384, rows_per_expert=hint),
        "w13_wgrad": rules.wgrad_config(out_rows=768, out_cols=512,
                                                rows_per_expert=hint),
    }
    if hint is not None:
        assert configs["w2_dgrad"].block_n == configs["w13_dgrad"].block_n == 256
    _chain_check(
        num_tokens=300,
        top_k=4,
        num_experts=6,
        experts=[0, 1, 2, 4, 5],
        hidden=512,
        ffn=384,
        block_m=128,
        configs=configs,
        offsets=offsets,
        scored=scored,
    )
