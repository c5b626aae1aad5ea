"""``distmoe.rowwise.scaled_expert_mlp``, the fused scaled expert node (issue 60, item 3), on
CPU ranks (gloo, the CPU heap, Triton's interpreter), EP 1 and 2, precisions mxfp8 and
fp8_block, SwiGLU saved and recomputed.

The composition it must equal, built from the separate nodes on the same inputs:
``dispatch_put_scaled`` of ``mxfp8_quantize(x)`` -> ``scaled_grouped_mm`` (W13) -> SwiGLU ->
``scaled_grouped_mm`` (W2) -> ``mxfp8_quantize`` -> ``combine_get_scaled``. The scaled PUT
is not differentiable, and the scaled combine only in ``probs``: the composition carries
its gradients through the bf16 nodes moving the same values (``dispatch_put`` of the
dequantised MXFP8 rows, whose bits must equal what the scaled PUT delivered; ``combine_get``
of the dequantised MXFP8 h3 rows, whose result must equal the scaled combine's bit for bit),
with the quantisations' derivative taken as one (``_Rounded``). SwiGLU is the FP8 training
layer's kernel pair (``swiglu_quantize`` / ``swiglu_backward_quantize``) in a two-line node.

Every kernel of the fused node is then one of the composition's, on the same values in the
same order, so the output and every gradient (x, probs, w13, w2) are compared bit for bit.
Where the fused node skips a quantisation (the received MXFP8 rows as W13's operand, the
SwiGLU kernels' ``Q(h2)`` / ``Q(gh1)``) the composition quantises the bf16 values again: the
equal bits also show that those shortcuts change nothing. The two recompute modes are
compared bit for bit, and the tensors each saves (seen through
``torch.autograd.graph.saved_tensors_hooks``) against the list in ``distmoe.rowwise.fused``'s
docstring.
"""

from __future__ import annotations

import functools

import pytest
import torch
from rowwise_cases import assert_bits_equal

import distmoe as dm
import distmoe.rowwise as rw
from distmoe.kernels.scaled.swiglu_quant import swiglu_backward_quantize, swiglu_quantize
from distmoe.quant import mxfp8_dequantize, mxfp8_quantize
from distmoe.reference import moe_reference, random_routing

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("rowwise_fused")

T, E, K = 6, 4, 2  # tokens per rank, experts, routes per token
SHAPES = {"mxfp8": (64, 32), "fp8_block": (128, 128)}  # (D, F): multiples of the block
BLOCK = {"mxfp8": 32, "fp8_block": 128}
PRECISIONS = tuple(SHAPES)
NAMES = ("y", "grad x", "grad probs", "grad w13", "grad w2")


def _problem(world, precision):
    D, F = SHAPES[precision]
    g = torch.Generator().manual_seed(600 + 10 * world + len(precision))
    x = torch.randn(world * T, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    ids, probs = random_routing(world * T, E, K, generator=g, inactive_fraction=0.1)
    gy = torch.randn(world * T, D, generator=g).bfloat16()
    return x, ids, probs.float(), w13, w2, gy


class _Rounded(torch.autograd.Function):
    """``value`` (x's quantisation, dequantised) with x's straight-through gradient."""

    @staticmethod
    def forward(ctx, x, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SwiGLU(torch.autograd.Function):
    """SwiGLU with the FP8 training layer's kernels (the quantised outputs unused here)."""

    @staticmethod
    def forward(ctx, h1, precision):
        R, F, B = h1.shape[0], h1.shape[1] // 2, BLOCK[precision]
        sdtype = torch.uint8 if precision == "mxfp8" else torch.float32
        h2 = torch.empty(R, F, dtype=torch.bfloat16)
        swiglu_quantize(h1, h2, torch.empty(R, F, dtype=torch.float8_e4m3fn),
                        torch.empty(R, F // B, dtype=sdtype), precision=precision)
        ctx.save_for_backward(h1)
        ctx.precision, ctx.sdtype = precision, sdtype
        return h2

    @staticmethod
    def backward(ctx, gh2):
        (h1,) = ctx.saved_tensors
        R, B = h1.shape[0], BLOCK[ctx.precision]
        gh1 = torch.empty_like(h1)
        swiglu_backward_quantize(h1, gh2.contiguous(), gh1,
                                 torch.empty(h1.shape, dtype=torch.float8_e4m3fn),
                                 torch.empty(R, h1.shape[1] // B, dtype=ctx.sdtype),
                                 precision=ctx.precision)
        return gh1, None


def _dequant(q, s):
    return mxfp8_dequantize(q, s, dtype=torch.bfloat16)


def _composed(bufs, leaves, ranks, rows, offs, precision):
    """The separate nodes; returns (outputs, checks of the scaled calls' bits)."""
    x, probs, w13, w2 = leaves
    e_local, _, F, D = w13.shape
    xq, xs = mxfp8_quantize(x.detach(), dim=-1)
    out_q, out_s = rw.dispatch_put_scaled(xq, xs, ranks, rows, bufs.out_q)
    got = rw.dispatch_put(_Rounded.apply(x, _dequant(xq, xs)), ranks, rows, bufs.out)
    same_rows = torch.equal(got.detach().view(torch.int16), _dequant(out_q, out_s).view(torch.int16))
    h1 = rw.scaled_grouped_mm(got, w13.view(e_local, 2 * F, D).transpose(1, 2), offs,
                              precision=precision)
    h2 = _SwiGLU.apply(h1, precision)
    h3 = rw.scaled_grouped_mm(h2, w2.transpose(1, 2), offs, precision=precision)
    hq, hs = mxfp8_quantize(h3.detach(), dim=-1)
    bufs.expert_out_q.copy_(hq)
    bufs.expert_out_s.copy_(hs)
    y_scaled = rw.combine_get_scaled(bufs.expert_out_q, ranks, rows, probs.detach())
    src = bufs.write("expert_out", _Rounded.apply(h3, _dequant(hq, hs)))
    y = rw.combine_get(src, ranks, rows, probs)
    same_y = torch.equal(y.detach().view(torch.int16), y_scaled.view(torch.int16))
    return y, same_rows and same_y


def _rank(rank, world):
    res = {}
    e_local = E // world
    for precision in PRECISIONS:
        x, ids, probs, w13, w2, gy = _problem(world, precision)
        D = x.shape[1]
        tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * e_local, (rank + 1) * e_local)
        inputs = (x[tok], probs[tok], w13[exp].contiguous(), w2[exp].contiguous())
        gy = gy[tok].float()
        ranks, rows, received = rw.expert_major_rows(ids[tok], E)
        offs = received.cumsum(0).to(torch.int32)
        with rw.Buffers(None, world * T * K, D, backend="cpu", scaled=True) as bufs:
            leaves = [t.clone().requires_grad_(True) for t in inputs]
            y, scaled_bits = _composed(bufs, leaves, ranks, rows, offs, precision)
            (y.float() * gy).sum().backward()
            res[precision, "composed"] = [y.detach()] + [t.grad for t in leaves]
            res[precision, "scaled calls"] = scaled_bits
            for recompute in (False, True):
                leaves = [t.clone().requires_grad_(True) for t in inputs]
                saved = []

                def pack(t, saved=saved):
                    saved.append((list(t.shape), t.dtype))
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = rw.scaled_expert_mlp(leaves[0], ranks, rows, leaves[1], leaves[2],
                                             leaves[3], offs, bufs, precision=precision,
                                             recompute_swiglu=recompute)
                (y.float() * gy).sum().backward()
                res[precision, recompute] = [y.detach()] + [t.grad for t in leaves]
                res[precision, recompute, "saved"] = saved
            with torch.no_grad():  # the forward without autograd: nothing kept, same bits
                res[precision, "no grad"] = rw.scaled_expert_mlp(
                    inputs[0], ranks, rows, inputs[1], inputs[2], inputs[3], offs, bufs,
                    precision=precision)
            res[precision, "rows"] = bufs.rows
    return res


@functools.cache
def _runs(world):
    """``dm.launch(_rank, world)``, once per process: pytest may set the parametrised module
    fixture below up more than once per EP size (its order interleaves them), and each run
    costs seconds in Triton's interpreter. The tests only read the results."""
    return dm.launch(_rank, world, timeout=300)


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def group(request):
    return request.param, _runs(request.param)


def _documented_saved(precision, recompute, rows, e_local):
    """The module docstring's table of ``distmoe.rowwise.fused``, in save order."""
    D, F = SHAPES[precision]
    B = BLOCK[precision]
    s = torch.uint8 if precision == "mxfp8" else torch.float32
    f8, bf = torch.float8_e4m3fn, torch.bfloat16
    out = [([rows, D], f8), ([rows, D // B], s),                             # a_q, a_s
           ([e_local, D, 2 * F], f8), ([e_local, D // B, 2 * F // B], s),   # w13t_q, w13t_s
           ([e_local, F, D], f8), ([e_local, F // B, D // B], s),           # w2t_q, w2t_s
           ([rows, 2 * F], bf)]                                             # h1
    if not recompute:
        out += [([rows, F], f8), ([rows, F // B], s)]                       # h2_q, h2_s
    out += [([T, K, D], bf)]                                                # routes
    idx = torch.int64
    out += [([T, K], torch.float32), ([T, K], idx), ([T, K], idx), ([e_local], torch.int32)]
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fused_equals_the_composition_bit_for_bit(group, precision):
    world, per_rank = group
    for r, res in enumerate(per_rank):
        assert res[precision, "scaled calls"], (
            f"rank {r}: the bf16 twins of the composition moved other bits than the scaled "
            "PUT / combine")
        for name, got, want in zip(NAMES, res[precision, False], res[precision, "composed"],
                                   strict=True):
            assert_bits_equal(got, want, f"rank {r} {precision} {name}")
        assert_bits_equal(res[precision, "no grad"], res[precision, False][0],
                          f"rank {r} {precision} y without autograd")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fused_is_the_moe_layer_up_to_fp8_error(group, precision):
    # A sanity bound against the float64 layer, not a precision claim: each of the forward's
    # 5 to 6 E4M3 roundings (x, (x again for fp8_block), both weights, h2, h3) is within 2^-4
    # of its value, and the backward's as many; their sum stays within 2^-2 of each tensor's
    # largest magnitude (observed below 2^-3), while a swapped gate / up or a transposed
    # weight is off by the order of the tensor itself.
    world, per_rank = group
    x, ids, probs, w13, w2, gy = _problem(world, precision)
    leaves = [t.double().requires_grad_(True) for t in (x, probs, w13, w2)]
    y64 = moe_reference(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    (y64 * gy.double()).sum().backward()
    e_local = E // world
    for r, res in enumerate(per_rank):
        tok, exp = slice(r * T, (r + 1) * T), slice(r * e_local, (r + 1) * e_local)
        ref = [y64[tok], leaves[0].grad[tok], leaves[1].grad[tok], leaves[2].grad[exp],
               leaves[3].grad[exp]]
        for name, got, want in zip(NAMES, res[precision, False], ref, strict=True):
            scale = want.abs().max().item()
            err = (got.double() - want).abs().max().item()
            assert err <= 0.25 * scale, f"rank {r} {precision} {name}: {err:.3g} of {scale:.3g}"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_recompute_gives_the_same_bits_and_saves_what_the_doc_lists(group, precision):
    world, per_rank = group
    for r, res in enumerate(per_rank):
        for name, a, b in zip(NAMES, res[precision, True], res[precision, False], strict=True):
            assert_bits_equal(a, b, f"rank {r} {precision} {name} (recompute vs saved)")
        for recompute in (False, True):
            want = _documented_saved(precision, recompute, res[precision, "rows"], E // world)
            assert res[precision, recompute, "saved"] == want, (
                f"rank {r} {precision} recompute_swiglu={recompute}")


def test_refusals_name_the_argument_before_touching_a_buffer():
    D, F = SHAPES["mxfp8"]
    x = torch.zeros(2, D, dtype=torch.bfloat16)
    ranks = torch.zeros(2, K, dtype=torch.int64)
    rows = torch.arange(2 * K, dtype=torch.int64).view(2, K)
    probs = torch.full((2, K), 0.5)
    w13 = torch.zeros(1, 2, F, D, dtype=torch.bfloat16)
    w2 = torch.zeros(1, D, F, dtype=torch.bfloat16)
    offs = torch.tensor([2 * K], dtype=torch.int32)
    with rw.Buffers(None, 8, D, backend="cpu") as bufs:
        with pytest.raises(ValueError, match=r"bufs must be built with scaled=True"):
            rw.scaled_expert_mlp(x, ranks, rows, probs, w13, w2, offs, bufs)
    with rw.Buffers(None, 8, D, backend="cpu", scaled=True) as bufs:
        for t in (bufs.out_q, bufs.expert_out_q):
            t.view(torch.uint8).fill_(0x5A)
        for t in (bufs.out_s, bufs.expert_out_s):
            t.fill_(0x5A)
        cases = [
            (TypeError, r"bufs must be a distmoe.rowwise.Buffers \(built with scaled=True\), "
                        r"got Tensor", dict(bufs=bufs.out_q)),
            (ValueError, r"w13 must be 4-D \[E, 2, F, D\] .*got shape \[1, 64, 64\]",
             dict(w13=w13.view(1, 2 * F, D))),
            (ValueError, r"w2 must have shape \[1, 64, 32\] \[E, D, F\] .*got \[1, 32, 64\]",
             dict(w2=w2.transpose(1, 2).contiguous())),
            (TypeError, r"offs must have dtype int32, got torch.int64", dict(offs=offs.long())),
            (ValueError, r"precision \('nvfp4'\) must be one of \['mxfp8', 'fp8_block'\]",
             dict(precision="nvfp4")),
            (ValueError, r"D \(the Buffers' hidden\) \(64\) must be a positive multiple of 128 "
                         r"for precision 'fp8_block'", dict(precision="fp8_block")),
            (ValueError, r"dst_rows must have shape \[2, 2\]", dict(dst_rows=rows[:, :1])),
            (TypeError, r"recompute_swiglu must be a bool, got 1", dict(recompute_swiglu=1)),
        ]
        for error, match, change in cases:
            args = dict(input=x, dst_ranks=ranks, dst_rows=rows, probs=probs, w13=w13, w2=w2,
                        offs=offs, bufs=bufs)
            args.update(change)
            with pytest.raises(error, match=match):
                rw.scaled_expert_mlp(**args)
        for t in (bufs.out_q, bufs.expert_out_q, bufs.out_s, bufs.expert_out_s):
            assert (t.view(torch.uint8) == 0x5A).all(), "a refused call touched a buffer"
        assert bufs.stats()["bad_put_routes"] == bufs.stats()["bad_get_routes"] == 0
    with rw.Buffers(None, 8, D, backend="cpu", scaled=True, grad=False) as bufs:
        with pytest.raises(ValueError, match=r"input, probs, w13 or w2 requires grad, but bufs "
                                             r"were built with grad=False"):
            rw.scaled_expert_mlp(x, ranks, rows, probs, w13.requires_grad_(), w2, offs, bufs)
