"""MXFP8 inference forward (``MoEConfig(precision="mxfp8", training=False)``) on CPU ranks
(Triton interpreter), EP 1-3, against two references with bounds derived in the comments:

(a) the same MXFP8 arithmetic in plain PyTorch (prepared weights dequantised, the rows and
    h2 quantised by the reference quantiser), bound = docs/numerics.md section 6 (fp32
    summation order, then one bf16 rounding per GEMM) carried through the layer;
(b) the bf16 layer in float64 (``distmoe.reference.moe_reference``), bound = MXFP8's
    per-element quantisation error (2^-4 relative, both operands of both GEMMs) carried
    through.

Also: prepared weights (kernel against reference, torch.save round trip), the scatter kernel
bit for bit, the receive bound (dropped routes counted and left out) and the refusals.
"""

from __future__ import annotations

import io

import pytest
import torch
from forward_cases import make_problem

import distmoe as dm
from distmoe.kernels.movement.scatter_rows import scatter_rows, scatter_rows_ref
from distmoe.quant import PreparedWeight, mxfp8_quantize_ref, prepare_weights
from distmoe.quant.formats import e8m0_exponent_ref, pow2_ref, round_minifloat_ref
from distmoe.reference import moe_reference, split_global_problem

D, F, T, K = 64, 64, 16, 2
U = 2.0**-24  # fp32 unit roundoff
SILU_LIP = 1.1  # |silu'(z)| <= 1.0998 for every z: silu is 1.1-Lipschitz
#: per 32-wide step on SM90 (docs/numerics.md section 6, the tensor core model):
#: 2^-13 * (32 max|a b| + |P_s|) <= 33 * 2^-13 * (the step's sum of |a b|)
TC_REL_GPU = 33 * 2.0**-13


# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


def _problem(seed, EP, T, E, K, case, dims=(D, F)):
    return make_problem(seed, EP, T, dims[0], dims[1], E, K, case)


def _mxfp8_rank(rank, world, seed, T, E, K, cases, factors, device="cpu", check=True,
                dims=(D, F), precision="mxfp8"):
    """Per case: (y, stats, second call equal) of this rank's MXFP8 context, with
    ``device_scratch_factor = factors[case]`` (unchecked where below the world size: the
    receive bound is then exceeded on purpose)."""
    dev = torch.device(device) if device == "cpu" else torch.device(
        "cuda", torch.cuda.current_device())
    out = []
    for case in cases:
        x, ids, scores, w13, w2 = _problem(seed, world, T, E, K, case, dims)
        mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
        w13p, w2p = prepare_weights(mine.w13.to(dev), mine.w2.to(dev), precision)
        cfg = dm.MoEConfig(hidden=dims[0], ffn=dims[1], num_experts=E, top_k=K, max_tokens=T,
                           precision=precision, training=False, row_block=16,
                           device_scratch_factor=factors[case])
        with dm.MoEContext(cfg, device=dev, check=check and factors[case] >= world) as ctx:
            args = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores)]
            y = ctx(*args, w13p, w2p)
            y2 = ctx(*args, w13p, w2p)  # buffer reuse is clean: the same bits
            stats = ctx.stats()
            assert ctx.graphs is None, "MXFP8 contexts run eagerly"
        out.append((y.cpu(), stats, torch.equal(y.view(torch.int16), y2.view(torch.int16))))
    return out


# --------------------------------------------------------------------------------------------
# References and bounds
# --------------------------------------------------------------------------------------------


def executed_routes(ids, EP, E, receive_bound):
    """bool [EP*T, K]: the routes the layer executes (distmoe.routing.tables, step 3): on each
    rank, routes in (expert, source rank, token, k) order, the first ``receive_bound``."""
    flat = ids.reshape(-1)
    done = torch.zeros_like(flat, dtype=torch.bool)
    E_local = E // EP
    for r in range(EP):
        pos = 0
        for e in range(r * E_local, (r + 1) * E_local):
            idx = (flat == e).nonzero().reshape(-1)
            done[idx] = torch.arange(pos, pos + idx.numel()) < receive_bound
            pos += idx.numel()
    return done.view(ids.shape)


def _routes(ids, scores, executed):
    n, k = executed.nonzero(as_tuple=True)
    return n, k, ids[n, k], scores[n, k].double()


def _bf16_ulp_allowance(value, delta):
    """Two values within ``delta`` of each other, each rounded to nearest bf16, differ by at
    most delta + one bf16 ulp at the larger magnitude <= delta + 2^-7 (|value| + delta)
    (8 significant bits), plus bf16's smallest subnormal."""
    return delta + 2.0**-7 * (value.abs() + delta) + 2.0**-133


def _quantize_at(v, e):
    """float64 values ``v`` quantised to E4M3 with block exponents ``e`` (the quantiser's
    rounding: nearest even, saturated at 448), dequantised."""
    scale = pow2_ref(e)
    return round_minifloat_ref(v / scale, 3, -6, 448.0) * scale


def _grouped(a, w, e):
    """``out[r] = w[e[r]] @ a[r]`` for rows a [R, K] and per-expert matrices w [E, N, K]
    (float64), one matmul per expert."""
    out = a.new_zeros(a.shape[0], w.shape[1])
    for ex in e.unique().tolist():
        idx = (e == ex).nonzero().reshape(-1)
        out[idx] = a[idx] @ w[ex].T
    return out


def _blocks(t):
    return t.unflatten(-1, (-1, 32))


def reference_a(x, ids, scores, w13p, w2p, executed, tc_rel=0.0):
    """(y, bound): the MXFP8 layer in plain PyTorch and, per element, a bound on |kernel -
    reference|. Both start from the same bits: the gathered rows are copies of x's rows and
    quantisation is row-local (mxfp8_quantize_ref of x = the kernel's quantised rows, bit for
    bit, tests/quant), and the prepared weights are shared. Then, per stage (S = sum of
    |a b| over a dot, dequantised operands; u = 2^-24; ``tc_rel`` the SM90 tensor-core term,
    0 on the CPU):

    * W13 accumulators: kernel within (31 + D/32 + 1) u S of exact (section 6), reference
      (float64 sum rounded once to fp32) within u S: e_g = (33 + D/32) u S_g + tc_rel S_g,
      same for u;
    * SwiGLU in fp32: |silu(g') u' - silu(g) u| <= 1.1 e_g (|u| + e_u) + |silu(g)| e_u, plus
      2^-20 |h2| for the two fp32 evaluations (a few roundings each);
    * bf16 rounding: the kernel's h2 lies in [rn(f - e), rn(f + e)] (rounding is monotone);
    * h2 quantisation along F: where the block exponent is the same at both ends of every
      element's interval, the kernel's quantised value lies in [Q(lo), Q(hi)] (monotone for
      a fixed exponent), so the difference is at most max(Q(hi) - Q(ref), Q(ref) - Q(lo)),
      zero for most elements; where it may differ, |h2 difference| plus both quantisation
      errors (2^-4 |v| + 2^(e - 10) each);
    * W2: |W2| @ dq + (33 + F/32) u S_2 + tc_rel S_2, then one bf16 ulp (as above);
    * combine: sum_k |s| d_h3 + 2 K u sum_k |s h3| (two fp32 sums), then one bf16 ulp.
    """
    D_ = x.shape[1]
    F_ = w2p.shape[2]
    assert D_ == w2p.shape[1]
    n, k, e, s = _routes(ids, scores, executed)
    xq, xs = mxfp8_quantize_ref(x[n])
    xr = dm.quant.mxfp8_dequantize(xq, xs).double()
    w13 = w13p.dequantize().double()  # [E, 2, F, D]
    w2 = w2p.dequantize().double()  # [E, D, F]
    h2, lo, hi, amin, amax = w13_swiglu_interval(xr, w13, e, (33 + D_ // 32) * U + tc_rel)
    # the h2 quantisation, element by element
    q_ref, s_ref = mxfp8_quantize_ref(h2)
    h2q = dm.quant.mxfp8_dequantize(q_ref, s_ref).double()
    e_lo = e8m0_exponent_ref(_blocks(amin).amax(-1))
    e_hi = e8m0_exponent_ref(_blocks(amax).amax(-1))
    e_elem = e_hi.repeat_interleave(32, dim=-1)
    same = (e_lo == e_hi).repeat_interleave(32, dim=-1)
    dq_same = torch.maximum(_quantize_at(hi, e_elem) - h2q, h2q - _quantize_at(lo, e_elem))
    dq_other = (hi - lo) + 2 * (2.0**-4 * amax + pow2_ref(e_elem - 10))
    dq = torch.where(same, dq_same, dq_other)
    h3, dh3 = w2_routes(h2q, dq, w2, e, (33 + F_ // 32) * U + tc_rel)
    return combine_ref(x.shape[0], ids.shape[1], n, k, s, h3, dh3)


def w13_swiglu_interval(xr, w13, e, rel13):
    """The W13 + SwiGLU stage of a reference (a): from the gathered rows ``xr`` and the
    dequantised ``w13`` (float64), with the kernel's accumulators within ``rel13 * S`` of
    exact, ``(h2, lo, hi, amin, amax)``: the reference's bf16 h2 (fp32 SwiGLU of the fp32
    rounded accumulators), the interval [lo, hi] in which the kernel's bf16 h2 lies (rounding
    is monotone), and per element the smallest and largest magnitude in it."""
    g64, u64 = _grouped(xr, w13[:, 0], e), _grouped(xr, w13[:, 1], e)
    sg, su = _grouped(xr.abs(), w13[:, 0].abs(), e), _grouped(xr.abs(), w13[:, 1].abs(), e)
    eg, eu = rel13 * sg, rel13 * su
    g32, u32 = g64.float(), u64.float()
    f32 = torch.nn.functional.silu(g32) * u32
    f = f32.double()
    ef = (SILU_LIP * eg * (u32.double().abs() + eu) + torch.nn.functional.silu(g32).double()
          .abs() * eu + 2.0**-20 * f.abs() + 2.0**-140)
    lo = (f - ef).bfloat16().double()
    hi = (f + ef).bfloat16().double()
    amin = torch.where((lo <= 0) & (hi >= 0), 0.0, torch.minimum(lo.abs(), hi.abs()))
    amax = torch.maximum(lo.abs(), hi.abs())
    return f32.bfloat16(), lo, hi, amin, amax


def w2_routes(h2q, dq, w2, e, rel2):
    """The W2 stage of a reference (a): ``(h3, dh3)``, the route results (bf16) from the
    quantised h2 ``h2q`` (float64, each element within ``dq`` of the kernel's) and the
    dequantised ``w2``, and their bound: ``|W2| @ dq + rel2 * S_2``, then one bf16 ulp."""
    s2 = _grouped(h2q.abs() + dq, w2.abs(), e)
    e2 = _grouped(dq, w2.abs(), e) + rel2 * s2
    h3 = _grouped(h2q, w2, e).float().bfloat16()
    return h3, _bf16_ulp_allowance(h3.double(), e2)


def combine_ref(num_tokens, top_k, n, k, s, h3, dh3):
    """(y, bound): the owner's combine of route results ``h3`` (bf16, route i of token n[i],
    slot k[i], score s[i]) each within ``dh3`` of the kernel's: an fp32 sum in k order, as
    the kernel does, then bf16; bound = sum_k |s| dh3 + 2 K u sum_k |s h3| (two fp32 sums),
    then one bf16 ulp."""
    acc = torch.zeros(num_tokens, h3.shape[1], dtype=torch.float32)
    order = torch.argsort(n * top_k + k)
    for i in order.tolist():
        acc[n[i]] += s[i].float() * h3[i].float()
    dy = torch.zeros(num_tokens, h3.shape[1], dtype=torch.float64)
    dy.index_add_(0, n, s.abs()[:, None] * dh3
                  + 2 * top_k * U * s.abs()[:, None] * (h3.double().abs() + dh3))
    return acc.bfloat16(), _bf16_ulp_allowance(acc.double(), dy)


def _quant_error_bound(v, e_elem):
    """docs/numerics.md section 2: |v - Q(v)| <= 2^(max(floor(log2|v|), e - 6) - 4)
    <= max(2^-4 |v|, 2^(e - 10)) for a block exponent e."""
    return torch.maximum(2.0**-4 * v.abs(), pow2_ref(e_elem - 10))


def _block_exponents(p):
    """The block exponent of every element of a prepared weight (int64, its shape)."""
    return (p.scales.to(torch.int64) - 127).repeat_interleave(32, -2).repeat_interleave(32, -1)


def _fp8_block_error_bound(v, block_max):
    """|v - Q(v)| for block FP8 with the block's largest magnitude at most ``block_max``
    (docs/numerics.md: half an E4M3 step at v / s, or 2^-10 s below E4M3's normal range,
    with s = amax / 448), widened by 2^-20 for the scale's and the division's roundings."""
    return torch.maximum(2.0**-4 * v.abs(), 2.0**-10 * block_max / 448.0) * (1 + 2.0**-20)


def _weight_block_max(w, b=128):
    """Per element of w [..., N, K], the largest |w| of its b x b block."""
    blocks = w.abs().unflatten(-1, (-1, b)).unflatten(-3, (-1, b))  # [..., N/b, b, K/b, b]
    return blocks.amax((-3, -1), keepdim=True).expand_as(blocks).reshape(w.shape)


def reference_b(x, ids, scores, w13, w2, executed, tc_rel=0.0, precision="mxfp8"):
    """(y64, bound): the bf16 layer in float64 over the executed routes, and a bound on
    |FP8 layer - y64| per element. Every operand of both GEMMs carries its quantisation
    error, at most 2^-4 relative (plus 2^(e - 10) for values far below their block's amax;
    block FP8: 2^-10 of the block scale): for a product, |a' b' - a b| <= da |b| + |a| db +
    da db; summed over a dot: |A| @ dB + dA @ |B| + dA @ dB, plus the kernel's fp32
    summation ((32 + K/32) u S' for MXFP8, (130 + K/128) u S' for 128-wide steps) and
    tc_rel S'. Carried through: silu is 1.1-Lipschitz; each bf16 rounding adds 2^-8 of the
    value (h2, h3, y); h2's quantisation uses the largest scale its block can have (from
    |h2| + its error); the combine adds K u per term."""
    n, k, e, s = _routes(ids, scores, executed)
    ids_run = torch.where(executed, ids, -1)
    y64 = moe_reference(x.double(), ids_run, torch.where(executed, scores, 0).double(),
                        w13.double(), w2.double())
    xr = x[n].double()
    w13r, w2r = w13.double(), w2.double()
    block = 32 if precision == "mxfp8" else 128
    if precision == "mxfp8":
        _, x_scales = mxfp8_quantize_ref(x[n])
        dx = _quant_error_bound(xr, x_scales.to(torch.int64).repeat_interleave(32, -1) - 127)
        w13p, w2p = prepare_weights(w13, w2, "mxfp8", reference=True)
        dw13 = _quant_error_bound(w13r, _block_exponents(w13p))
        dw2 = _quant_error_bound(w2r, _block_exponents(w2p))
    else:
        x_max = xr.abs().unflatten(-1, (-1, 128)).amax(-1).repeat_interleave(128, -1)
        dx = _fp8_block_error_bound(xr, x_max)
        dw13 = _fp8_block_error_bound(w13r, _weight_block_max(w13r))
        dw2 = _fp8_block_error_bound(w2r, _weight_block_max(w2r))

    def dot_error(a, da, w, dw, width):
        # a [R, K], w [E, N, K]: error of the quantised dot per output column
        err = _grouped(da, w.abs(), e) + _grouped(a.abs(), dw, e) + _grouped(da, dw, e)
        big = _grouped(a.abs() + da, w.abs() + dw, e)
        steps = (32 + width // 32) if block == 32 else (130 + width // 128)
        return err + (steps * U + tc_rel) * big

    g, u = _grouped(xr, w13r[:, 0], e), _grouped(xr, w13r[:, 1], e)
    eg = dot_error(xr, dx, w13r[:, 0], dw13[:, 0], x.shape[1])
    eu = dot_error(xr, dx, w13r[:, 1], dw13[:, 1], x.shape[1])
    h2 = torch.nn.functional.silu(g) * u
    e_h2 = (SILU_LIP * eg * (u.abs() + eu) + torch.nn.functional.silu(g).abs() * eu
            + 2.0**-20 * h2.abs())
    e_h2 = e_h2 + 2.0**-8 * (h2.abs() + e_h2)  # bf16 rounding of h2
    amax = h2.abs().add(e_h2).unflatten(-1, (-1, block)).amax(-1)
    if precision == "mxfp8":
        e_block = e8m0_exponent_ref(amax).repeat_interleave(32, -1)
        e_h2 = e_h2 + _quant_error_bound(h2.abs() + e_h2, e_block)  # h2 quantised along F
    else:
        e_h2 = e_h2 + _fp8_block_error_bound(h2.abs() + e_h2,
                                             amax.repeat_interleave(128, -1))
    h3 = _grouped(h2, w2r, e)
    e_h3 = dot_error(h2, e_h2, w2r, dw2, w2.shape[2])
    e_h3 = e_h3 + 2.0**-8 * (h3.abs() + e_h3)  # bf16 rounding of h3
    dy = torch.zeros_like(y64)
    dy.index_add_(0, n, s.abs()[:, None] * (e_h3 + ids.shape[1] * U * (h3.abs() + e_h3)))
    return y64, dy + 2.0**-8 * (y64.abs() + dy)


def _worst_ratio(err, bound):
    return torch.where(bound > 0, err / bound, 0.0).max().item()


def _check_case(y, seed, EP, T, E, K, case, receive_bound, tc_rel=0.0, dims=(D, F)):
    """y [EP*T, D] against (a) and (b); returns the worst ratios error / bound and the
    executed routes."""
    x, ids, scores, w13, w2 = _problem(seed, EP, T, E, K, case, dims)
    executed = executed_routes(ids, EP, E, receive_bound)
    ratios = []
    # 32 x 32 blocks never straddle two experts: all experts at once give each rank's bits
    w13p, w2p = prepare_weights(w13, w2, "mxfp8", reference=True)
    y_a, bound_a = reference_a(x, ids, scores, w13p, w2p, executed, tc_rel)
    err_a = (y.double() - y_a.double()).abs()
    assert (err_a <= bound_a).all(), (
        f"{case}: (a) error {err_a.max():.3g} above its bound at "
        f"{(err_a > bound_a).nonzero()[0].tolist()}")
    ratios.append(_worst_ratio(err_a, bound_a))
    y64, bound_b = reference_b(x, ids, scores, w13, w2, executed, tc_rel)
    err_b = (y.double() - y64).abs()
    assert (err_b <= bound_b).all(), (
        f"{case}: (b) error {err_b.max():.3g} above its bound at "
        f"{(err_b > bound_b).nonzero()[0].tolist()}")
    ratios.append(_worst_ratio(err_b, bound_b))
    # tokens whose routes are all inactive or dropped: exact zeros
    idle = ~executed.any(1)
    assert torch.equal(y[idle], torch.zeros_like(y[idle])), f"{case}: idle tokens"
    return ratios, executed


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

#: case -> device_scratch_factor as a multiple of EP (>= 1: room for any routing; below:
#: the receive bound is exceeded and the extra routes dropped)
_CASES = {
    "balanced": 1.0,
    "imbalance_8x": 1.0,  # skewed: most routes to rank 0's experts
    "inactive_mix": 1.0,  # 40% inactive routes, one all-inactive token
    "all_to_one_expert": 0.25,  # every token to one expert, beyond the receive bound
}


@pytest.mark.parametrize("EP, E", [(1, 8), (2, 8), (3, 6)])
def test_mxfp8_forward_against_both_references(EP, E):
    seed = 58 + EP
    factors = {c: f * EP for c, f in _CASES.items()}
    per_rank = dm.launch(_mxfp8_rank, EP, args=(seed, T, E, K, list(_CASES), factors))
    for i, case in enumerate(_CASES):
        y = torch.cat([r[i][0] for r in per_rank])
        stats = [r[i][1] for r in per_rank]
        assert all(r[i][2] for r in per_rank), f"{case}: second call differs"
        cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                           precision="mxfp8", training=False, row_block=16,
                           device_scratch_factor=factors[case])
        bound = cfg.receive_bound(EP)
        _, executed = _check_case(y, seed, EP, T, E, K, case, bound)
        ids = _problem(seed, EP, T, E, K, case)[1]
        E_l = E // EP
        for rank, st in enumerate(stats):
            received = ((ids >= rank * E_l) & (ids < (rank + 1) * E_l)).sum().item()
            assert st["last_recv_rows"] == received, case
            assert st["dropped_rows"] == 2 * (received - min(received, bound)), case
        if case == "all_to_one_expert":
            # the bound was hit: some routes were dropped, and only those
            assert (~executed & (ids >= 0)).any()


def test_prepared_weights_round_trip():
    E = 4
    w13 = (torch.randn(E, 2, F, D) / 8).bfloat16()
    w2 = (torch.randn(E, D, F) / 8).bfloat16()
    w13[0, 0, 0, 0] = 300.0  # an outlier: its block's small values underflow
    w13p, w2p = prepare_weights(w13, w2, "mxfp8")
    r13, r2 = prepare_weights(w13, w2, "mxfp8", reference=True)
    for p, r, w in ((w13p, r13, w13), (w2p, r2, w2)):
        assert p.shape == tuple(w.shape) and p.precision == "mxfp8"
        assert p.qdata.dtype == torch.float8_e4m3fn and p.scales.dtype == torch.uint8
        assert list(p.scales.shape) == [*w.shape[:-2], w.shape[-2] // 32, w.shape[-1] // 32]
        # kernel against reference, bit for bit
        assert torch.equal(p.qdata.view(torch.uint8), r.qdata.view(torch.uint8))
        assert torch.equal(p.scales, r.scales)
        # within the quantiser's bound of the source
        err = (p.dequantize().double() - w.double()).abs()
        e_elem = (p.scales.to(torch.int64) - 127).repeat_interleave(32, -2).repeat_interleave(
            32, -1)
        assert (err <= _quant_error_bound(w.double(), e_elem)).all()
    buf = io.BytesIO()
    torch.save({"w13": w13p, "w2": w2p}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True (the default): the class is registered
    for name, p in (("w13", w13p), ("w2", w2p)):
        q = loaded[name]
        assert isinstance(q, PreparedWeight) and q.shape == p.shape
        assert q.precision == p.precision
        assert torch.equal(q.qdata.view(torch.uint8), p.qdata.view(torch.uint8))
        assert torch.equal(q.scales, p.scales)
    assert w13p.to("cpu") is w13p


def test_prepare_weights_refusals():
    E = 2
    w13 = torch.zeros(E, 2, F, D, dtype=torch.bfloat16)
    w2 = torch.zeros(E, D, F, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="precision .'bf16'. must be one of"):
        prepare_weights(w13, w2, "bf16")
    with pytest.raises(ValueError, match=r"w2 must be \[E_local=2, D=64, F=64\]"):
        prepare_weights(w13, w2[:, :32].contiguous())
    with pytest.raises(ValueError, match=r"D \(48\) must be a multiple of 32"):
        prepare_weights(torch.zeros(E, 2, F, 48), torch.zeros(E, 48, F))
    with pytest.raises(TypeError, match="w13 must be bfloat16, float16 or float32"):
        prepare_weights(w13.to(torch.int32), w2)
    w13p, w2p = prepare_weights(w13, w2)
    with pytest.raises(TypeError, match="w13 is a PreparedWeight already"):
        prepare_weights(w13p, w2)


def test_scatter_rows_bit_exact_with_null_rows():
    # two experts, row block 16: 5 and 0 live rows, one null destination among them
    rows = torch.randn(8, D).bfloat16()
    dest = torch.full((10, D), float("nan"), dtype=torch.bfloat16)
    dest_ref = dest.clone()
    po = torch.tensor([0, 16, 16], dtype=torch.int32)
    ro = torch.tensor([0, 5, 5], dtype=torch.int32)
    r_cap = 32
    ptrs = torch.zeros(r_cap, dtype=torch.int64)
    targets = [7, 0, 3, -1, 9]  # route slots; -1 = null
    for j, t in enumerate(targets):
        if t >= 0:
            ptrs[j] = dest.data_ptr() + t * D * 2
    ptrs_ref = torch.where(ptrs != 0, ptrs - dest.data_ptr() + dest_ref.data_ptr(), 0)
    ptrs[20] = 1  # a padding row's entry is never read
    scatter_rows(rows, po, ro, ptrs, block_m=16)
    scatter_rows_ref(rows, po, ro, ptrs_ref, [dest_ref], block_m=16)
    assert torch.equal(dest.view(torch.int16), dest_ref.view(torch.int16))
    for j, t in enumerate(targets):
        if t >= 0:
            assert torch.equal(dest[t].view(torch.int16), rows[j].view(torch.int16))
    untouched = [i for i in range(10) if i not in targets]
    assert dest[untouched].isnan().all()


def _context_refusals_rank(rank, world):
    E = 4
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=8,
                       precision="mxfp8", training=False, row_block=16)
    x = torch.randn(8, D).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(8)])
    scores = torch.rand(8, K)
    w13 = torch.randn(E, 2, F, D).bfloat16() / 8
    w2 = torch.randn(E, D, F).bfloat16() / 8
    w13p, w2p = prepare_weights(w13, w2)
    small13, small2 = prepare_weights(w13[:2], w2[:2])
    msgs = {}
    with dm.MoEContext(cfg, device="cpu", check=True) as ctx:
        cases = {
            "raw w13": (x, ids, scores, w13, w2p),
            "raw w2": (x, ids, scores, w13p, w2),
            "w13 shape": (x, ids, scores, small13, w2p),
            "w2 shape": (x, ids, scores, w13p, small2),
            "swapped": (x, ids, scores, w2p, w13p),
            "x dtype": (x.float(), ids, scores, w13p, w2p),
            "ids shape": (x, ids[:, :1].contiguous(), scores, w13p, w2p),
        }
        for name, args in cases.items():
            try:
                ctx(*args)
            except (TypeError, ValueError) as exc:
                msgs[name] = f"{type(exc).__name__}: {exc}"
        y = ctx(x, ids, scores, w13p, w2p)  # still usable after the refusals
        msgs["ok"] = tuple(y.shape)
        # x written into the input buffer: the same bits without the copy
        buf = ctx.input_buffer(8)
        buf.copy_(x)
        msgs["input buffer"] = torch.equal(ctx(buf, ids, scores, w13p, w2p).view(torch.int16),
                                           y.view(torch.int16))
        # T = 0: an empty y
        msgs["T=0"] = tuple(ctx(x[:0], ids[:0], scores[:0], w13p, w2p).shape)
    return msgs


def test_context_refusals():
    msgs = dm.launch(_context_refusals_rank, 1)[0]
    assert msgs["ok"] == (8, D) and msgs["input buffer"] and msgs["T=0"] == (0, D)
    assert msgs["raw w13"].startswith("TypeError: w13 must be a PreparedWeight")
    assert "prepare_weights" in msgs["raw w13"]
    assert msgs["raw w2"].startswith("TypeError: w2 must be a PreparedWeight")
    assert msgs["w13 shape"].startswith("ValueError: w13 must be prepared from a weight of "
                                        "shape [4, 2, 64, 64]")
    assert msgs["w2 shape"].startswith("ValueError: w2 must be prepared from a weight of "
                                       "shape [4, 64, 64]")
    assert msgs["swapped"].startswith("ValueError: w13 must be prepared")
    assert msgs["x dtype"] == "TypeError: x must be torch.bfloat16, got torch.float32"
    assert msgs["ids shape"].startswith("ValueError: expert_ids must be [T, top_k]")


@pytest.mark.gpu
def test_mxfp8_forward_gpu():
    """One GPU at a moderate shape (EP = 1, T = 512, D = 512, F = 224, E = 16, K = 4): both
    references, with the SM90 tensor-core term in the bounds (docs/numerics.md section 6).
    F = 224 keeps exact MXFP8 (32-wide K groups; at D and F multiples of 128 the layer
    rebases onto 128-wide groups, tested in tests/ops/test_fp8_training.py)."""
    T_, E, K_, dims = 512, 16, 4, (512, 224)
    cases = ["balanced", "imbalance_8x", "inactive_mix"]
    out = _mxfp8_rank(0, 1, 7, T_, E, K_, cases, {c: 1.0 for c in cases}, device="cuda",
                      dims=dims)
    bound = dm.MoEConfig(hidden=dims[0], ffn=dims[1], num_experts=E, top_k=K_, max_tokens=T_,
                         precision="mxfp8", training=False).receive_bound(1)
    for i, case in enumerate(cases):
        y, stats, same = out[i]
        assert same and stats["dropped_rows"] == 0, case
        _check_case(y, 7, 1, T_, E, K_, case, bound, tc_rel=TC_REL_GPU, dims=dims)
