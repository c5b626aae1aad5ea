"""NVFP4 inference forward (``MoEConfig(precision="nvfp4", training=False)``: NVFP4 weights;
bf16 activations at EP = 1, rows packed as NVFP4 by their owners at EP > 1) on CPU ranks
(Triton interpreter), EP 1-3 (one launch each), against two references with bounds derived
in the comments:

(a) the same arithmetic in plain PyTorch (prepared weights decoded exactly to ``v * s_b``,
    float64 dots rounded to fp32, times the global scale, SwiGLU in fp32, bf16 h2 and h3, the
    fp32 combine), bound = the fp32 summation order (docs/numerics.md, the NVFP4 GEMM section)
    carried through the layer;
(b) the bf16 layer in float64 (``distmoe.reference.moe_reference``), bound = NVFP4's
    per-element weight quantisation error (docs/numerics.md section 4) carried through.

Also: prepared weights (kernel against reference bit for bit, the section-4 bound, torch.save
round trip), the refusals. D = 48 and F = 32 put partial K and N tiles in both GEMMs.
"""

from __future__ import annotations

import io

import pytest
import torch
from forward_cases import make_problem
from test_mxfp8_forward import executed_routes

import distmoe as dm
from distmoe.kernels.scaled.nvfp4 import nvfp4_weight_values
from distmoe.plan import rules
from distmoe.quant import PreparedWeight, prepare_weights
from distmoe.quant.nvfp4 import nvfp4_quantize_ref
from distmoe.reference import moe_reference, split_global_problem

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

D, F, T, K = 48, 32, 12, 2
U = 2.0**-24  # fp32 unit roundoff
SILU_LIP = 1.1  # |silu'(z)| <= 1.0998 for every z
#: GPU margin on the fp32 summation term (bf16 WGMMA accumulation: a model to confirm)
GPU_SUM_FACTOR = 2.0


# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


def _problem(seed, EP, T, E, K, case, dims=(D, F)):
    return make_problem(seed, EP, T, dims[0], dims[1], E, K, case)


def _cfg(E, T_, factor, dims=(D, F), K_=K, row_block=16):
    return dm.MoEConfig(hidden=dims[0], ffn=dims[1], num_experts=E, top_k=K_, max_tokens=T_,
                        precision="nvfp4", training=False, row_block=row_block,
                        device_scratch_factor=factor)


def _refusals(dev, E):
    """The call's refusals on one rank: {case: "Type: message"}."""
    cfg = _cfg(E, 8, 1.0)
    x = torch.randn(8, D).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(8)]).to(dev)
    scores = torch.rand(8, K).to(dev)
    w13 = (torch.randn(E, 2, F, D) / 8).bfloat16().to(dev)
    w2 = (torch.randn(E, D, F) / 8).bfloat16().to(dev)
    w13p, w2p = prepare_weights(w13, w2, "nvfp4", reference=True)
    small13, _ = prepare_weights(w13[:2], w2[:2], "nvfp4", reference=True)
    cases = {
        "raw w13": (x, ids, scores, w13, w2p),
        "raw w2": (x, ids, scores, w13p, w2),
        "w13 shape": (x, ids, scores, small13, w2p),
        "swapped": (x, ids, scores, w2p, w13p),
    }
    msgs = {}
    with dm.MoEContext(cfg, device=dev, check=True) as ctx:
        for name, args in cases.items():
            try:
                ctx(*args)
            except (TypeError, ValueError) as exc:
                msgs[name] = f"{type(exc).__name__}: {exc}"
        msgs["ok"] = tuple(ctx(x, ids, scores, w13p, w2p).shape)  # usable after refusals
        msgs["T=0"] = tuple(ctx(x[:0], ids[:0], scores[:0], w13p, w2p).shape)
    # weights prepared for another precision (mxfp8 needs multiples of 32: D, F = 64)
    cfg64 = _cfg(E, 8, 1.0, dims=(64, 64))
    m13, m2 = prepare_weights(torch.zeros(E, 2, 64, 64), torch.zeros(E, 64, 64), "mxfp8",
                              reference=True)
    with dm.MoEContext(cfg64, device=dev, check=True) as ctx:
        try:
            ctx(torch.zeros(8, 64, dtype=torch.bfloat16, device=dev), ids, scores, m13, m2)
        except ValueError as exc:
            msgs["mxfp8 weights"] = f"ValueError: {exc}"
    return msgs


def _nvfp4_rank(rank, world, seed, T_, E, K_, cases, factors, device="cpu", check=True,
                dims=(D, F), pull_all=None, fp8_operands=None, row_block=16):
    """Per case: (y, stats, second call equal) of this rank's NVFP4 context with
    ``device_scratch_factor = factors[case]`` (unchecked where below the world size: the
    receive bound is then exceeded on purpose); at EP 1 also the refusals. ``pull_all``:
    force how peer rows are copied (every peer row at once, or the named ones). The stats
    carry ``swapped``: whether the plan gave both GEMMs transposed tiles."""
    dev = torch.device(device) if device == "cpu" else torch.device(
        "cuda", torch.cuda.current_device())
    out = []
    for case in cases:
        x, ids, scores, w13, w2 = _problem(seed, world, T_, E, K_, case, dims)
        mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
        # the plain-PyTorch quantiser on the CPU (the kernel's bits, test_prepared_weights_
        # round_trip; far faster under the interpreter), the kernel on a GPU
        w13p, w2p = prepare_weights(mine.w13.to(dev), mine.w2.to(dev), "nvfp4",
                                    reference=device == "cpu")
        cfg = _cfg(E, T_, factors[case], dims, K_, row_block)
        layer = {k: v for k, v in (("pull_all", pull_all), ("fp8_operands", fp8_operands))
                 if v is not None}
        overrides = {"layer": layer} if layer else None
        with dm.MoEContext(cfg, device=dev, check=check and factors[case] >= world,
                           overrides=overrides) as ctx:
            args = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores)]
            y = ctx(*args, w13p, w2p)
            y2 = ctx(*args, w13p, w2p)  # buffer reuse is clean: the same bits
            stats = ctx.stats()
            stats["swapped"] = ctx._lowp.w13_config.swap_ab and ctx._lowp.w2_config.swap_ab
            assert ctx.graphs is None, "NVFP4 contexts run eagerly"
            assert (ctx._lowp.fp8 is not None) == bool(fp8_operands), "the planned operands"
        out.append((y.cpu(), stats, torch.equal(y.view(torch.int16), y2.view(torch.int16))))
    refusals = _refusals(dev, 4) if world == 1 and device == "cpu" else None
    return out, refusals


# --------------------------------------------------------------------------------------------
# References and bounds
# --------------------------------------------------------------------------------------------


def _grouped(a, w, e):
    """``out[r] = w[e[r]] @ a[r]`` for rows a [R, K] and per-expert w [E, N, K] (float64)."""
    out = a.new_zeros(a.shape[0], w.shape[1])
    for ex in e.unique().tolist():
        idx = (e == ex).nonzero().reshape(-1)
        out[idx] = a[idx] @ w[ex].T
    return out


def _bf16_ulp_allowance(value, delta):
    """Two values within ``delta``, each rounded to nearest bf16, differ by at most delta +
    one bf16 ulp at the larger magnitude <= delta + 2^-7 (|value| + delta), plus bf16's
    smallest subnormal."""
    return delta + 2.0**-7 * (value.abs() + delta) + 2.0**-133


def _combine(n, k, s, h3, dh3, Ntok, K_):
    """The fp32 combine in the kernel's order (k ascending per token) and its bound."""
    acc = torch.zeros(Ntok, h3.shape[1], dtype=torch.float32)
    for i in torch.argsort(n * K_ + k).tolist():
        acc[n[i]] += s[i].float() * h3[i].float()
    dy = torch.zeros(Ntok, h3.shape[1], dtype=torch.float64)
    dy.index_add_(0, n, s.abs()[:, None] * dh3
                  + 2 * K_ * U * s.abs()[:, None] * (h3.double().abs() + dh3))
    return acc.bfloat16(), _bf16_ulp_allowance(acc.double(), dy)


def reference_a(x, ids, scores, w13p, w2p, executed, sum_factor=1.0, x_scale=None):
    """(y, bound): the NVFP4-weight layer in plain PyTorch and a per-element bound on |layer -
    reference|. Both read the same bits (the gathered rows are x's rows; the prepared weights
    are bit-identical, test_prepared_weights_round_trip). With ``x_scale`` (rows packed by
    their owners, EP > 1): ``x`` holds the rows' decoded ``v * s_b`` and ``x_scale [T]`` their
    global scales, multiplied into the weights' in fp32 as the kernel does (the same product
    on both sides: no extra term). Per GEMM with K values, S = sum
    |a w| over the decoded operands and s_g the expert's global scale: the kernel's fp32
    accumulator is within (K + 1) u S of the exact sum and its global-scale product adds u;
    the reference (float64, then fp32, then the product) adds 2 u |exact|: together
    (K + 4) u S s_g, times 1.01 for second-order terms. SwiGLU: silu is 1.1-Lipschitz and the
    two fp32 evaluations differ by a few roundings (2^-20 relative); bf16 rounding is
    monotone, so the kernel's h2 lies in [rn(f - e), rn(f + e)]; W2 adds |w2| @ dh2 s_g; each
    bf16 rounding one ulp; the combine two fp32 sums of K terms."""
    n, k = executed.nonzero(as_tuple=True)
    e, s = ids[n, k], scores[n, k].double()
    xr = x[n].double()
    v13 = nvfp4_weight_values(w13p.qdata, w13p.scales).double()  # [E, 2, F, D]
    v2 = nvfp4_weight_values(w2p.qdata, w2p.scales).double()  # [E, D, F]
    g13, g2 = w13p.global_scale[e][:, None], w2p.global_scale[e][:, None]
    if x_scale is not None:
        g13 = g13 * x_scale[n][:, None]
    D_, F_ = x.shape[1], v2.shape[2]
    g32 = _grouped(xr, v13[:, 0], e).float() * g13
    u32 = _grouped(xr, v13[:, 1], e).float() * g13
    rel13 = 1.01 * (D_ + 4) * U * sum_factor
    eg = rel13 * _grouped(xr.abs(), v13[:, 0].abs(), e) * g13.double()
    eu = rel13 * _grouped(xr.abs(), v13[:, 1].abs(), e) * g13.double()
    f32 = torch.nn.functional.silu(g32) * u32
    f = f32.double()
    ef = (SILU_LIP * eg * (u32.double().abs() + eu)
          + torch.nn.functional.silu(g32).double().abs() * eu + 2.0**-20 * f.abs() + 2.0**-140)
    h2 = f32.bfloat16()
    h2d = h2.double()
    dh2 = torch.maximum((f + ef).bfloat16().double() - h2d, h2d - (f - ef).bfloat16().double())
    h3 = (_grouped(h2d, v2, e).float() * g2).bfloat16()
    s2 = _grouped(h2d.abs() + dh2, v2.abs(), e)
    e2 = (_grouped(dh2, v2.abs(), e) + 1.01 * (F_ + 4) * U * sum_factor * s2) * g2.double()
    dh3 = _bf16_ulp_allowance(h3.double(), e2)
    return _combine(n, k, s, h3, dh3, x.shape[0], ids.shape[1])


def weight_error_bound(w, p):
    """docs/numerics.md section 4, per element of a prepared weight with its block decode
    factor D_b = s_b s_g: |w - w_hat| <= (2^-2 + 2^-21) max(|w|, D_b)
    + 6 * 2^-10 s_g (1 + 2^-21) + 2^-146."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    s_g = p.global_scale.double().view(shape)
    d_b = p.scales.double().repeat_interleave(16, -1) * s_g
    return ((2.0**-2 + 2.0**-21) * torch.maximum(w.double().abs(), d_b)
            + 6 * 2.0**-10 * s_g * (1 + 2.0**-21) + 2.0**-146)


def row_error_bound(x, packed_scales, global_scale):
    """The section-4 bound for rows quantised with a global scale per row (``global_scale
    [T, 1]``): the weights' formula with ``s_g`` per row."""
    s_g = global_scale.double()
    d_b = packed_scales.double().repeat_interleave(16, -1) * s_g
    return ((2.0**-2 + 2.0**-21) * torch.maximum(x.double().abs(), d_b)
            + 6 * 2.0**-10 * s_g * (1 + 2.0**-21) + 2.0**-146)


def fp8_operand_error(v, row_quantum):
    """The E4M3 rounding of FP8 operands (docs/numerics.md, the FP4 weights on FP8
    operands), for values of magnitude up to ``v`` (float64): at most 2^-4 of the value while
    an E4M3 normal, plus ``row_quantum`` times the row's largest ``v`` (the subnormal step:
    2^-10 of a 1 x 128 block's scale amax / 448 for activations, 2^-10 * 2^(e - 5) <= 2^-15 of
    the row's largest weight for the expanded weights)."""
    return 2.0**-4 * v + row_quantum * v.amax(-1, keepdim=True)


def reference_b(x, ids, scores, w13, w2, executed, sum_factor=1.0, dx=None, fp8_ops=False):
    """(y64, bound): the bf16 layer in float64 over the executed routes and a bound on |NVFP4
    layer - y64|. Activations are exact (bf16 rows) or, with ``dx [T, D]`` (rows packed by
    their owners), carry their own section-4 error bound ``dx``; each weight carries
    its section-4 error dw, so a dot errs by at most |a| @ dw (plus da @ (|w| + dw) where the
    input a carries da), plus the kernel's fp32 summation ((K + 2) u S', S' over |w| + dw).
    Carried through: silu is 1.1-Lipschitz; each bf16 rounding (h2, h3, y) adds 2^-8 of the
    value; the combine adds K u per term. ``fp8_ops``: the GEMMs on FP8 operands, so x and
    h2 carry their E4M3 1 x 128 quantisation and each weight its E4M3 expansion too
    (:func:`fp8_operand_error`)."""
    n, k = executed.nonzero(as_tuple=True)
    e, s = ids[n, k], scores[n, k].double()
    y64 = moe_reference(x.double(), torch.where(executed, ids, -1),
                        torch.where(executed, scores, 0).double(), w13.double(), w2.double())
    xr = x[n].double()
    w13p, w2p = prepare_weights(w13, w2, "nvfp4", reference=True)
    dw13, dw2 = weight_error_bound(w13, w13p), weight_error_bound(w2, w2p)
    w13r, w2r = w13.double(), w2.double()

    def dot_error(a, da, w, dw, width):
        big = _grouped(a.abs() + da, w.abs() + dw, e)
        return (_grouped(a.abs(), dw, e) + _grouped(da, w.abs() + dw, e)
                + 1.01 * (width + 2) * U * sum_factor * big)

    dxr = torch.zeros_like(xr) if dx is None else dx[n]
    if fp8_ops:
        dxr = dxr + fp8_operand_error(xr.abs() + dxr, 2.0**-10 / 448)
        dw13 = dw13 + fp8_operand_error(w13r.abs() + dw13, 2.0**-15)
        dw2 = dw2 + fp8_operand_error(w2r.abs() + dw2, 2.0**-15)
    g, u = _grouped(xr, w13r[:, 0], e), _grouped(xr, w13r[:, 1], e)
    eg = dot_error(xr, dxr, w13r[:, 0], dw13[:, 0], x.shape[1])
    eu = dot_error(xr, dxr, w13r[:, 1], dw13[:, 1], x.shape[1])
    h2 = torch.nn.functional.silu(g) * u
    e_h2 = (SILU_LIP * eg * (u.abs() + eu) + torch.nn.functional.silu(g).abs() * eu
            + 2.0**-20 * h2.abs())
    e_h2 = e_h2 + 2.0**-8 * (h2.abs() + e_h2)  # bf16 rounding of h2
    if fp8_ops:  # h2 quantised for W2
        e_h2 = e_h2 + fp8_operand_error(h2.abs() + e_h2, 2.0**-10 / 448)
    h3 = _grouped(h2, w2r, e)
    e_h3 = dot_error(h2, e_h2, w2r, dw2, w2.shape[2])
    e_h3 = e_h3 + 2.0**-8 * (h3.abs() + e_h3)  # bf16 rounding of h3
    dy = torch.zeros_like(y64)
    dy.index_add_(0, n, s.abs()[:, None] * (e_h3 + ids.shape[1] * U * (h3.abs() + e_h3)))
    return y64, dy + 2.0**-8 * (y64.abs() + dy)


def _check_case(y, seed, EP, T_, E, K_, case, receive_bound, sum_factor=1.0, dims=(D, F)):
    """y [EP*T, D] against (a) and (b); returns (bit-identical to (a), the executed routes)."""
    x, ids, scores, w13, w2 = _problem(seed, EP, T_, E, K_, case, dims)
    executed = executed_routes(ids, EP, E, receive_bound)
    # a global scale per expert: all experts prepared at once give each rank's bits
    w13p, w2p = prepare_weights(w13, w2, "nvfp4", reference=True)
    x_a, x_scale, dx = x, None, None
    if rules.packs_nvfp4_rows(precision="nvfp4", ep_size=EP):  # rows packed by their owners
        packed, scales, gs = nvfp4_quantize_ref(x, per="row")  # the kernel's bits
        x_a, x_scale = nvfp4_weight_values(packed, scales), gs[:, 0]
        dx = row_error_bound(x, scales, gs)
    y_a, bound_a = reference_a(x_a, ids, scores, w13p, w2p, executed, sum_factor, x_scale)
    err_a = (y.double() - y_a.double()).abs()
    assert (err_a <= bound_a).all(), (
        f"{case}: (a) error {err_a.max():.3g} above its bound at "
        f"{(err_a > bound_a).nonzero()[0].tolist()}")
    y64, bound_b = reference_b(x, ids, scores, w13, w2, executed, sum_factor, dx)
    err_b = (y.double() - y64).abs()
    assert (err_b <= bound_b).all(), (
        f"{case}: (b) error {err_b.max():.3g} above its bound at "
        f"{(err_b > bound_b).nonzero()[0].tolist()}")
    idle = ~executed.any(1)  # tokens with no executed route: exact zeros
    assert torch.equal(y[idle], torch.zeros_like(y[idle])), f"{case}: idle tokens"
    return torch.equal(y.view(torch.int16), y_a.view(torch.int16)), executed


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

#: case -> device_scratch_factor as a multiple of EP (below 1: the receive bound is exceeded
#: and the extra routes dropped)
_CASES = {
    "imbalance_8x": 1.0,  # skewed: most routes to rank 0's experts
    "inactive_mix": 1.0,  # 40% inactive routes, one all-inactive token
    "all_to_one_expert": 0.25,  # every token to one expert, beyond the receive bound
}
#: the cases of each EP size (one launch each; CI time: two cases per launch)
_EP_CASES = {1: ("inactive_mix", "all_to_one_expert"), 2: ("imbalance_8x", "all_to_one_expert"),
             3: ("imbalance_8x", "inactive_mix")}


@pytest.mark.parametrize("EP, E", [(1, 8), (2, 8), (3, 6)])
def test_nvfp4_forward_against_both_references(EP, E):
    seed = 59 + EP
    cases = _EP_CASES[EP]
    factors = {c: _CASES[c] * EP for c in cases}
    results = dm.launch(_nvfp4_rank, EP, args=(seed, T, E, K, list(cases), factors))
    per_rank = [r[0] for r in results]
    for i, case in enumerate(cases):
        y = torch.cat([r[i][0] for r in per_rank])
        assert all(r[i][2] for r in per_rank), f"{case}: second call differs"
        bound = _cfg(E, T, factors[case]).receive_bound(EP)
        _, executed = _check_case(y, seed, EP, T, E, K, case, bound)
        ids = _problem(seed, EP, T, E, K, case)[1]
        E_l = E // EP
        for rank, r in enumerate(per_rank):
            st = r[i][1]
            received = ((ids >= rank * E_l) & (ids < (rank + 1) * E_l)).sum().item()
            assert st["last_recv_rows"] == received, case
            assert st["dropped_rows"] == 2 * (received - min(received, bound)), case
        if case == "all_to_one_expert":
            assert (~executed & (ids >= 0)).any()  # the bound was hit: routes dropped
    if EP == 1:
        _check_refusals(results[0][1])


@pytest.mark.parametrize("EP", [1, 2])
def test_decode_plan_with_transposed_tiles_within_both_references(EP):
    """A decode-sized layer (rows per expert below the plan's ``fp4_swap_rows``, padding
    multiple 32) runs both GEMMs on transposed tiles (decoded weights as the MMA's M side),
    within the same references and bounds as the padded tiles."""
    seed, E, case = 71 + EP, 8, "imbalance_8x"
    results = dm.launch(_swap_rank, EP, args=(seed, E, case))
    y = torch.cat([r[0][0][0] for r in results])
    assert all(r[0][0][1]["swapped"] and r[0][0][2] for r in results)
    bound = _cfg(E, T, 1.0 * EP, row_block=32).receive_bound(EP)
    _check_case(y, seed, EP, T, E, K, case, bound)


def _swap_rank(rank, world, seed, E, case):
    return _nvfp4_rank(rank, world, seed, T, E, K, [case], {case: 1.0 * world}, row_block=32)


def test_decode_call_on_a_prefill_sized_context_takes_the_transposed_tiles():
    """A context planned for many rows per expert (max_tokens 256: padded tiles) gives a call
    of few tokens the transposed configs (chosen per call from its token count) and a full
    call the planned ones; the decode call within both references, and explain() lists
    both pairs."""
    seed, E, case, T_max = 81, 8, "imbalance_8x", 256
    cfg = _cfg(E, T_max, 1.0, row_block=32)
    x, ids, scores, w13, w2 = _problem(seed, 1, T, E, K, case)
    w13p, w2p = prepare_weights(w13, w2, "nvfp4", reference=True)
    with dm.MoEContext(cfg, device="cpu") as ctx:
        s = ctx._lowp
        planned = (s.w13_config, s.w2_config)
        assert not planned[0].swap_ab and s.decode is not None
        assert all(c.swap_ab for c in s.configs(T, K)), "a decode call: transposed tiles"
        assert s.configs(T_max, K) == planned
        text = ctx.explain()
        assert "w13 decode" in text and "transposed" in text, text
        y = ctx(x, ids, scores, w13p, w2p)
        assert ctx.stats()["dropped_rows"] == 0
    _check_case(y, seed, 1, T, E, K, case, cfg.receive_bound(1))


def test_packed_rows_pulled_at_once_or_as_named_give_the_same_bits():
    """EP = 2: the packed rows copied from every peer at once (copy engines, their packed
    bytes only) or as the tables name them give the same bits, within both references."""
    seed, E, case = 71, 8, "inactive_mix"
    ys = {}
    for pull_all in (True, False):
        results = dm.launch(_nvfp4_rank, 2, args=(seed, T, E, K, [case], {case: 2.0}, "cpu",
                                                  True, (D, F), pull_all))
        ys[pull_all] = torch.cat([r[0][0][0] for r in results])
    assert torch.equal(ys[True].view(torch.int16), ys[False].view(torch.int16))
    _check_case(ys[True], seed, 2, T, E, K, case, _cfg(E, T, 2.0).receive_bound(2))


@pytest.mark.parametrize("EP", [1, 2])
def test_fp8_operands_within_the_bf16_layer_bound(EP):
    """The plan's FP8-operand form (``overrides={"layer": {"fp8_operands": True}}``: x and
    h2 quantised to E4M3 in 1 x 128 blocks, the weights expanded to E4M3): against the bf16
    layer in float64, reference (b) with the E4M3 roundings added, at EP 1 (x gathered and
    quantised in one kernel) and EP 2 (packed rows decoded, then quantised). D = F = 128."""
    seed, E, case, dims = 83 + EP, 8, "inactive_mix", (128, 128)
    results = dm.launch(_nvfp4_rank, EP, args=(seed, T, E, K, [case], {case: float(EP)},
                                               "cpu", True, dims, None, True))
    y = torch.cat([r[0][0][0] for r in results])
    assert all(r[0][0][2] for r in results), "second call differs"
    x, ids, scores, w13, w2 = _problem(seed, EP, T, E, K, case, dims)
    executed = executed_routes(ids, EP, E, _cfg(E, T, float(EP), dims).receive_bound(EP))
    dx = None
    if rules.packs_nvfp4_rows(precision="nvfp4", ep_size=EP):
        _, scales, gs = nvfp4_quantize_ref(x, per="row")
        dx = row_error_bound(x, scales, gs)
    y64, bound = reference_b(x, ids, scores, w13, w2, executed, 2.0, dx, fp8_ops=True)
    err = (y.double() - y64).abs()
    assert (err <= bound).all(), f"error {err.max():.3g} above its bound"


def _check_refusals(msgs):
    assert msgs["ok"] == (8, D) and msgs["T=0"] == (0, D)
    assert msgs["raw w13"].startswith("TypeError: w13 must be a PreparedWeight for precision "
                                      "'nvfp4'")
    assert "prepare_weights(w13, w2, 'nvfp4')" in msgs["raw w13"]
    assert msgs["raw w2"].startswith("TypeError: w2 must be a PreparedWeight")
    assert msgs["w13 shape"].startswith("ValueError: w13 must be prepared from a weight of "
                                        "shape [4, 2, 32, 48]")
    assert msgs["swapped"].startswith("ValueError: w13 must be prepared")
    assert msgs["mxfp8 weights"] == ("ValueError: w13 was prepared for precision 'mxfp8', the "
                                     "context runs 'nvfp4'")


def test_training_refused():
    with pytest.raises(ValueError, match="precision 'nvfp4' is inference only"):
        dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=K, max_tokens=8,
                     precision="nvfp4", training=True)
    with pytest.raises(ValueError, match=r"hidden \(40\) must be a multiple of 16"):
        dm.MoEConfig(hidden=40, ffn=F, num_experts=4, top_k=K, max_tokens=8,
                     precision="nvfp4", training=False)


def test_prepared_weights_round_trip():
    E, F_, D_ = 2, 16, 32  # the quantiser kernel is slow under the interpreter: tiny
    w13 = (torch.randn(E, 2, F_, D_) / 8).bfloat16()
    w2 = (torch.randn(E, D_, F_) / 8).bfloat16()
    w13[0, 0, 0, 0] = 300.0  # an outlier: its block's small values underflow
    w2[1] *= 2.0**-20  # an expert far smaller than the other: its own global scale
    w13p, w2p = prepare_weights(w13, w2, "nvfp4")
    r13, r2 = prepare_weights(w13, w2, "nvfp4", reference=True)
    for p, r, w in ((w13p, r13, w13), (w2p, r2, w2)):
        assert p.shape == tuple(w.shape) and p.precision == "nvfp4"
        assert p.qdata.dtype == torch.uint8 and list(p.qdata.shape) == [*w.shape[:-1],
                                                                          w.shape[-1] // 2]
        assert p.scales.dtype == torch.float8_e4m3fn
        assert list(p.scales.shape) == [*w.shape[:-1], w.shape[-1] // 16]
        assert p.global_scale.dtype == torch.float32 and list(p.global_scale.shape) == [E]
        # kernel against reference, bit for bit
        assert torch.equal(p.qdata, r.qdata)
        assert torch.equal(p.scales.view(torch.uint8), r.scales.view(torch.uint8))
        assert torch.equal(p.global_scale, r.global_scale)
        # one global scale per expert matrix: max(amax(w[e]) / 2688, 2^-126)
        amax = w.float().abs().flatten(1).amax(1)
        want = torch.clamp(amax / torch.full_like(amax, 2688.0), min=2.0**-126)
        assert torch.equal(p.global_scale, want)
        # the format's own dequantisation agrees with the kernel's decode times s_g (two fp32
        # roundings apart at most) and lies within section 4's bound of the source
        deq = p.dequantize().double()
        shape = (-1,) + (1,) * (w.dim() - 1)
        via = nvfp4_weight_values(p.qdata, p.scales).double() * p.global_scale.double().view(
            shape)
        assert ((deq - via).abs() <= 2 * 2.0**-24 * via.abs() + 2.0**-148).all()
        assert ((deq - w.double()).abs() <= weight_error_bound(w, p)).all()
    buf = io.BytesIO()
    torch.save({"w13": w13p, "w2": w2p}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True (the default): the class is registered
    for name, p in (("w13", w13p), ("w2", w2p)):
        q = loaded[name]
        assert isinstance(q, PreparedWeight) and q.shape == p.shape
        assert q.precision == "nvfp4"
        assert torch.equal(q.qdata, p.qdata)
        assert torch.equal(q.scales.view(torch.uint8), p.scales.view(torch.uint8))
        assert torch.equal(q.global_scale, p.global_scale)
    assert w13p.to("cpu") is w13p


def test_prepare_weights_refusals():
    E = 2
    w13 = torch.zeros(E, 2, F, D, dtype=torch.bfloat16)
    w2 = torch.zeros(E, D, F, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"D \(40\) must be a multiple of 16 for precision "
                                         "'nvfp4'"):
        prepare_weights(torch.zeros(E, 2, F, 40), torch.zeros(E, 40, F), "nvfp4")
    with pytest.raises(ValueError, match="precision .'fp4'. must be one of"):
        prepare_weights(w13, w2, "fp4")
    p13, _ = prepare_weights(w13, w2, "nvfp4", reference=True)
    # an all-zero weight: global scale 2^-126, block scales and codes 0
    assert torch.equal(p13.global_scale, torch.full((E,), 2.0**-126))
    assert not p13.qdata.any() and not p13.scales.view(torch.uint8).any()
    with pytest.raises(ValueError, match=r"global_scale must be a contiguous float32 tensor "
                                         r"of shape \[2\]"):
        PreparedWeight(p13.qdata, p13.scales, p13.shape, "nvfp4")
    with pytest.raises(TypeError, match="qdata must be a uint8 tensor"):
        PreparedWeight(p13.scales, p13.scales, p13.shape, "nvfp4", p13.global_scale)
    with pytest.raises(ValueError, match="global_scale must be None for precision 'mxfp8'"):
        m13, _ = prepare_weights(torch.zeros(E, 2, 32, 32), torch.zeros(E, 32, 32), "mxfp8",
                                 reference=True)
        PreparedWeight(m13.qdata, m13.scales, m13.shape, "mxfp8", p13.global_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("T_, row_block", [(512, 16), (16, 128)], ids=["padded", "decode"])
def test_nvfp4_forward_gpu(T_, row_block):
    """One GPU at a moderate shape (EP = 1, T = 512, D = 512, F = 256, E = 16, K = 4), and at
    decode (T = 16, 128-row padding: the plan's transposed tiles): both references, with the
    GPU margin on the fp32 summation terms (a model to confirm)."""
    E, K_, dims = 16, 4, (512, 256)
    cases = ["balanced", "imbalance_8x", "inactive_mix"]
    out, _ = _nvfp4_rank(0, 1, 7, T_, E, K_, cases, {c: 1.0 for c in cases}, device="cuda",
                         dims=dims, row_block=row_block)
    bound = _cfg(E, T_, 1.0, dims, K_, row_block).receive_bound(1)
    for i, case in enumerate(cases):
        y, stats, same = out[i]
        assert same and stats["dropped_rows"] == 0, case
        assert stats["swapped"] == (T_ * K_ // E < 32), case
        _check_case(y, 7, 1, T_, E, K_, case, bound, sum_factor=GPU_SUM_FACTOR, dims=dims)


@pytest.mark.gpu
def test_nvfp4_forward_gpu_two_ranks_sharing_it():
    """EP = 2 as two ranks on one GPU (IPC heap): rows packed by their owners, the packed
    bytes pulled, decoded by the gather and scaled in W13 (T = 256 per rank, D = 512,
    F = 256, E = 16, K = 4), within both references with the GPU margin."""
    T_, E, K_, dims, case = 256, 16, 4, (512, 256), "imbalance_8x"
    results = dm.launch(_nvfp4_rank, 2, device="cuda", gpus=[0], timeout=600,
                        args=(7, T_, E, K_, [case], {case: 2.0}, "cuda", True, dims))
    y = torch.cat([r[0][0][0] for r in results])
    assert all(r[0][0][2] for r in results)
    bound = _cfg(E, T_, 2.0, dims, K_).receive_bound(2)
    _check_case(y, 7, 2, T_, E, K_, case, bound, sum_factor=GPU_SUM_FACTOR, dims=dims)
