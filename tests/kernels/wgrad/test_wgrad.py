"""The grouped WGRAD of both backward GEMMs (Triton and Gluon) against the plain-PyTorch references.

Layouts, poisoning and tolerances: :mod:`backward_cases` (tests/kernels/backward_cases.py).
"""

import pytest
import torch
from backward_cases import (
    DEVICE,
    ROUNDING_REL,
    Layout,
    act_rows,
    layout_from_counts,
    poisoned,
    row_table,
    same_bits,
)

from distmoe.kernels.wgrad.config import WgradConfig
from distmoe.kernels.wgrad.triton import w2_wgrad, w2_wgrad_ref, w13_wgrad, w13_wgrad_ref
from distmoe.plan import device_class, rules, thresholds


def assert_wgrad_close(actual, a, b, layout, before, *, rows_sum):
    """fp32 WGRAD against the reference, per element: both sides sum exact bf16 products in
    fp32 (at most ~50 terms plus ``before``), only in different orders, so each is within
    n * 2^-24 (< 1e-5 / 2) of the exact sum relative to ``|before| + sum |a_i b_i|``. The
    bound is computed from the operands, so experts whose rows are large keep their own
    scale: a row of the next (large) expert leaking into a small expert breaks it by orders
    of magnitude."""
    expected = rows_sum(a, b, layout.padded_offsets, layout.row_offsets, before)
    magnitude = rows_sum(a.abs(), b.abs(), layout.padded_offsets, layout.row_offsets, before.abs())
    assert torch.isfinite(actual).all(), "WGRAD output holds NaN/inf"
    excess = (actual - expected).abs() - 1e-5 * magnitude
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e}"


def _wgrad_operand(layout, width, *, big_experts):
    """bf16 [R_act, width] activation rows; rows of ``big_experts`` scaled by 2^10 (what the
    last, partial row step of the expert before them loads), NaN in the spare rows."""
    out = torch.randn(layout.num_act, width, device=DEVICE)
    rows = layout.row_offsets.tolist()
    for e in big_experts:
        out[rows[e] : rows[e + 1]] *= 1024.0
    out = out.bfloat16()
    out[~layout.live_act()] = float("nan")
    return out


@pytest.mark.parametrize("split_rows", [1, 3])
@pytest.mark.parametrize("one_expert", [False, True])
def test_w2_wgrad(split_rows, one_expert):
    num_experts, hidden, ffn, block_m = 5, 48, 40, 16
    # Live rows per expert (block_k 16): partial last steps of 5 rows, an empty expert, a
    # whole-step count (32) and, with split_rows 3, programs whose only step is partial.
    counts = [0, 0, 0, 45, 0] if one_expert else [21, 0, 32, 37, 5]
    layout = layout_from_counts(counts, block_m, extra_tiles={1: 1})
    grad_h3 = _wgrad_operand(layout, hidden, big_experts=[2, 4])
    h2 = _wgrad_operand(layout, ffn, big_experts=[2, 4])
    grad_w2 = torch.randn(num_experts, hidden, ffn, device=DEVICE)  # existing .grad
    before = grad_w2.clone()
    config = WgradConfig(
        block_m=block_m,
        block_k=16,
        block_out_m=32,
        block_out_n=32,
        split_rows=split_rows,
        num_warps=4,
        num_stages=2,
    )

    w2_wgrad(grad_h3, h2, layout.padded_offsets, layout.row_offsets, grad_w2, config=config)

    assert_wgrad_close(grad_w2, grad_h3, h2, layout, before, rows_sum=w2_wgrad_ref)
    for e, count in enumerate(counts):
        if count == 0:  # experts without rows: bit-exact untouched
            assert same_bits(grad_w2[e], before[e])


@pytest.mark.parametrize(
    "split_rows,host_descriptors",
    [(1, True), (2, False)],  # split rows with atomics; TMA descriptors built in the kernel
)
def test_w13_wgrad(split_rows, host_descriptors):
    num_experts, hidden, ffn, block_m = 3, 40, 24, 32
    counts = [40, 0, 19]  # expert 1: no rows; partial last steps (8 and 3 rows)
    layout = layout_from_counts(counts, block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    x = _wgrad_operand(layout, hidden, big_experts=[2])
    grad_w13 = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    before = grad_w13.clone()
    config = WgradConfig(
        block_m=block_m,
        block_k=16,
        block_out_m=32,
        block_out_n=16,
        split_rows=split_rows,
        num_warps=4,
        num_stages=2,
        host_descriptors=host_descriptors,
    )

    w13_wgrad(grad_h1, x, layout.padded_offsets, layout.row_offsets, grad_w13, config=config)

    assert_wgrad_close(grad_w13, grad_h1, x, layout, before, rows_sum=w13_wgrad_ref)
    assert same_bits(grad_w13[1], before[1])


@pytest.mark.parametrize("host_descriptors", [True, False])
def test_w13_wgrad_x_offset(host_descriptors):
    """x_gathered at a device-side offset into a 1-D base (device-built descriptor, bounded by
    the live rows): bit-exact equal to the plain path (same row steps, same order)."""
    num_experts, hidden, ffn, block_m = 3, 40, 24, 32
    layout = layout_from_counts([40, 0, 19], block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    x = _wgrad_operand(layout, hidden, big_experts=[2])
    before = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    config = WgradConfig(
        block_m=block_m,
        block_k=16,
        block_out_m=32,
        block_out_n=16,
        num_warps=4,
        num_stages=2,
        host_descriptors=host_descriptors,
    )
    plain = before.clone()
    w13_wgrad(grad_h1, x, layout.padded_offsets, layout.row_offsets, plain, config=config)

    offset = 8 * 9  # elements: 16-byte aligned, not a multiple of a row (D = 40)
    # Only the live rows sit in the base, followed by NaN: nothing past row_offsets[E] is read.
    live_x = x[: layout.live_end].reshape(-1)
    base = torch.full((offset + live_x.numel() + 3 * hidden,), float("nan"), device=DEVICE)
    base = base.bfloat16()
    base[offset : offset + live_x.numel()] = live_x
    x_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    got = before.clone()
    w13_wgrad(
        grad_h1,
        base,
        layout.padded_offsets,
        layout.row_offsets,
        got,
        x_offset=x_offset,
        config=config,
    )
    assert same_bits(got, plain)


def kept_x_rows(layout: Layout, hidden: int, *, top_k: int = 2, null_every: int = 7):
    """What a layer that kept its input hands the W13 WGRAD at EP = 1: token-major x
    ``[T, D]`` (token = route // ``top_k``) inside a NaN-poisoned 1-D base at an offset, and a
    table naming, by padded row, rows of another buffer (``origin``'s rows, never read) with
    the same pitch. Every ``null_every``-th live row is null (0: zeros); padding and idle rows
    name the NaN row just past x (read, it shows). Returns ``(base, x_offset, table, origin,
    x_gathered, origin_buffer)``: ``x_gathered`` the ``[R_act, D]`` rows the table stands
    for (NaN in spare rows), ``origin_buffer`` what ``origin`` points into (keep it alive)."""
    route = layout.route_of_row
    tokens = max(1, int(route.max()) // top_k + 1)
    x_tok = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    offset = 8 * 3  # elements: 16-byte aligned, not a multiple of a row
    base = poisoned(offset + (tokens + 1) * hidden)
    base[offset:offset + tokens * hidden] = x_tok.reshape(-1)
    origin_buffer = poisoned(tokens + 1, hidden)
    null = (route >= 0) & (torch.arange(route.numel()) % null_every == 3)
    # padding and idle rows: the row past x's tokens (its shifted address is base's NaN row)
    table = row_table(layout, origin_buffer, canary=origin_buffer[tokens:], null_rows=null,
                      top_k=top_k)
    x_gathered = act_rows(layout, x_tok, top_k=top_k)
    x_gathered[layout.act_of_row[null].to(DEVICE)] = 0
    # [offset, 0]: the rows through the table (the second entry is in_order_rows' switch)
    x_offset = torch.tensor([offset, 0], dtype=torch.int64, device=DEVICE)
    return base, x_offset, table, origin_buffer.data_ptr(), x_gathered, origin_buffer


def in_order_rows(x_gathered: torch.Tensor, origin: int):
    """The other way of the x_rows path: rows stored in activation order (a layer that kept
    its gathered rows) inside a NaN-poisoned 1-D base at an offset, and ``x_offset`` ``[offset,
    origin]`` telling the kernel to leave the table unread. Returns ``(base, x_offset)``."""
    rows, hidden = x_gathered.shape
    offset = 8 * 5
    base = poisoned(offset + (rows + 1) * hidden)
    base[offset:offset + rows * hidden] = x_gathered.reshape(-1)
    return base, torch.tensor([offset, origin], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize(
    "split_rows,host_descriptors,accumulate",
    [(1, True, True), (2, False, True), (1, True, False), (1, False, False)],
)
def test_w13_wgrad_x_rows(split_rows, host_descriptors, accumulate):
    """x's rows read in place through the gather table (``x_rows``): the same bits as the
    same kernel over the gathered rows stored in order (same row steps, same order; split
    rows add their partial sums by atomics, in an order that varies between runs on a GPU,
    so there within fp32 rounding of the sum), with null rows (zeros), NaN where a padding
    row's address points, NaN around x, and an empty expert and partial last steps."""
    num_experts, hidden, ffn, block_m = 4, 40, 24, 32
    layout = layout_from_counts([40, 0, 19, 33], block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    base, x_offset, table, origin, x_gathered, _keep = kept_x_rows(layout, hidden)
    before = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE)
    config = WgradConfig(block_m=block_m, block_k=16, block_out_m=32, block_out_n=16,
                         split_rows=split_rows, num_warps=4, num_stages=2,
                         host_descriptors=host_descriptors)
    po, ro = layout.padded_offsets, layout.row_offsets
    plain = before.clone() if accumulate else poisoned(*before.shape, dtype=torch.float32)
    w13_wgrad(grad_h1, x_gathered, po, ro, plain, accumulate=accumulate, config=config)
    got = before.clone() if accumulate else poisoned(*before.shape, dtype=torch.float32)
    w13_wgrad(grad_h1, base, po, ro, got, x_offset=x_offset, accumulate=accumulate,
              config=config, x_rows=table, rows_origin=origin)
    # the same launch with the rows stored in order and the switch set: the table (all null
    # here, so read it would give zeros) is left unread
    ordered_base, ordered_offset = in_order_rows(x_gathered, origin)  # NaN past the live rows
    ordered = before.clone() if accumulate else poisoned(*before.shape, dtype=torch.float32)
    w13_wgrad(grad_h1, ordered_base, po, ro, ordered, x_offset=ordered_offset,
              accumulate=accumulate, config=config, x_rows=torch.zeros_like(table),
              rows_origin=origin)
    assert torch.isfinite(got).all() and torch.isfinite(ordered).all()
    bound = 4 * 2.0**-24 * (before.abs() + w13_wgrad_ref(
        grad_h1.abs(), x_gathered.abs(), po, ro, torch.zeros_like(before)))
    for result in (got, ordered):
        if split_rows == 1 or DEVICE.type == "cpu":
            assert same_bits(result, plain)
        else:  # fp32 atomics: a few roundings of the accumulated magnitude apart
            assert ((result - plain).abs() <= bound).all()
    if accumulate:
        assert_wgrad_close(got, grad_h1, x_gathered, layout, before, rows_sum=w13_wgrad_ref)


@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_overwrite(out_dtype, host_descriptors):
    """accumulate=False: every element written (zeros for the expert without rows) over a
    NaN-poisoned output; fp32 equals accumulating into zeros bit for bit (same row steps, same
    order, and 0 + acc is exact); bf16 is that fp32 result rounded once (RNE)."""
    num_experts, hidden, ffn, block_m = 3, 40, 24, 32
    layout = layout_from_counts([40, 0, 19], block_m, idle_tiles=1)
    grad_h1 = _wgrad_operand(layout, 2 * ffn, big_experts=[2])
    x = _wgrad_operand(layout, hidden, big_experts=[2])
    grad_h3 = _wgrad_operand(layout, hidden, big_experts=[2])
    h2 = _wgrad_operand(layout, ffn, big_experts=[2])
    config = WgradConfig(block_m=block_m, block_k=16, block_out_m=32, block_out_n=16,
                         num_warps=4, num_stages=2, host_descriptors=host_descriptors)
    po, ro = layout.padded_offsets, layout.row_offsets
    acc13 = torch.zeros(num_experts, 2, ffn, hidden, device=DEVICE)
    w13_wgrad(grad_h1, x, po, ro, acc13, config=config)
    acc2 = torch.zeros(num_experts, hidden, ffn, device=DEVICE)
    w2_wgrad(grad_h3, h2, po, ro, acc2, config=config)
    got13 = poisoned(num_experts, 2, ffn, hidden, dtype=out_dtype)
    w13_wgrad(grad_h1, x, po, ro, got13, accumulate=False, config=config)
    got2 = poisoned(num_experts, hidden, ffn, dtype=out_dtype)
    w2_wgrad(grad_h3, h2, po, ro, got2, accumulate=False, config=config)
    assert same_bits(got13, acc13.to(out_dtype)) and same_bits(got2, acc2.to(out_dtype))
    assert not got13[1].any() and not got2[1].any()  # the expert without rows: zeros
    # The epilogue is a TMA store when out is 16-byte aligned (above), pointer stores when not
    # (an out starting one element into its storage): same bits.
    unaligned = poisoned(num_experts * hidden * ffn + 1, dtype=out_dtype)[1:]
    unaligned = unaligned.view(num_experts, hidden, ffn)
    assert unaligned.data_ptr() % 16
    w2_wgrad(grad_h3, h2, po, ro, unaligned, accumulate=False, config=config)
    assert same_bits(unaligned, got2)
    split = WgradConfig(block_m=block_m, block_k=16, block_out_m=32, block_out_n=16,
                        split_rows=2, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match=r"accumulate=False needs config.split_rows == 1"):
        w2_wgrad(grad_h3, h2, po, ro, got2, accumulate=False, config=split)
    with pytest.raises(TypeError, match=r"grad_w2 must have dtype .*float32.*, got torch.bfloat16"):
        w2_wgrad(grad_h3, h2, po, ro, got2.bfloat16(), config=config)


def _gluon_configs():
    from distmoe.kernels.wgrad.gluon import GLUON_WGRAD_CONFIGS

    return GLUON_WGRAD_CONFIGS


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["main", "ws", "pp"])
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("kind", ["W2", "W13_x_offset", "W2_p_tail"])
@pytest.mark.parametrize("cfg", _gluon_configs(), ids=lambda c: "x".join(map(str, c)))
def test_gluon_wgrad(cfg, kind, programs, form):
    """The Gluon kernel (bf16 out, overwrite) over a NaN-poisoned output against the fp64-exact
    sum of the same bf16 products: each element within one bf16 rounding (2^-8 relative) plus
    fp32 accumulation on both sides (2 * rows * 2^-24 of the magnitude sum). Row counts: an
    empty expert (zeros), fewer rows than one step, whole steps, partial last steps (ending
    inside a 16-row slice, and on a slice boundary: 48); the rows after each small expert
    are scaled by 2^10 and the spare rows are NaN, so a partial step that reads past its
    expert's end shows. With 3 programs every program walks several tiles (the load
    stream crosses tile boundaries, empty tiles included). W13's x sits at a device offset
    (descriptor built on the device). P not a multiple of ``block_p`` (``W2_p_tail``: D =
    320, 64 rows past the last whole 128- or 256-row block; W13 with 256-row blocks: 2F =
    384): each expert's last row block is stored clipped, and the NaN-poisoned output shows
    a store past an expert's rows (the next expert's first rows would be overwritten).
    ``form``: the plain kernel, the warp-specialised one ("ws"), or its ping-pong form
    ("pp", configs of 4 warps and 128 rows: also the same bits as "ws" with two cooperating
    warpgroups)."""
    from distmoe.kernels.wgrad.gluon import gluon_wgrad_supported, launch_gluon_wgrad

    block_p, block_q, stages, warps, block_k = cfg
    specialized, pingpong = form != "main", form == "pp"
    if specialized and block_q > 128:
        pytest.skip("the warp-specialised kernel takes block_q <= 128")
    if pingpong and (warps != 4 or block_p != 128):
        pytest.skip("the ping-pong form takes warpgroups of 4 warps over 128 rows")
    counts = [0, 37, 64, 200, 1, 128, 301, 0, 75, 48]
    layout = layout_from_counts(counts, 128, idle_tiles=1)
    big = [e + 1 for e, c in enumerate(counts[:-1]) if 0 < c < 128]
    hidden, ffn = (320 if kind == "W2_p_tail" else 256), 192
    if kind.startswith("W2"):
        width_p, width_q = hidden, ffn  # Q below block_q: clipped columns
    else:
        width_p, width_q = 2 * ffn, hidden
    a = _wgrad_operand(layout, width_p, big_experts=big)
    b = _wgrad_operand(layout, width_q, big_experts=big)
    out = poisoned(len(counts), width_p, width_q)
    assert gluon_wgrad_supported(a, out, block_p, block_q) is None
    b_offset = None
    if kind == "W13_x_offset":
        offset = 8 * 5  # elements: 16-byte aligned, not a multiple of a row
        base = poisoned(offset + b.numel() + width_q)
        base[offset:offset + b.numel()] = b.reshape(-1)
        b_src, b_offset = base, torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    else:
        b_src = b
    launch_gluon_wgrad(a, b_src, layout.row_offsets, out, b_offset=b_offset, block_p=block_p,
                       block_q=block_q, stages=stages, num_warps=warps, block_k=block_k,
                       programs=programs, specialized=specialized, pingpong=pingpong)
    if pingpong:  # the same MMAs per tile as two cooperating warpgroups of the same kernel
        coop = poisoned(len(counts), width_p, width_q)
        launch_gluon_wgrad(a, b_src, layout.row_offsets, coop, b_offset=b_offset,
                           block_p=block_p, block_q=block_q, stages=stages, num_warps=8,
                           block_k=block_k, programs=programs, specialized=True)
        assert same_bits(coop, out)

    zeros = torch.zeros(len(counts), width_p, width_q, device=DEVICE)
    po, ro = layout.padded_offsets, layout.row_offsets
    expected = w2_wgrad_ref(a, b, po, ro, zeros.clone())
    magnitude = w2_wgrad_ref(a.abs(), b.abs(), po, ro, zeros.clone())
    got = out.float()
    assert torch.isfinite(got).all(), "an output element was not written (NaN poison left)"
    # fp32 sums of up to max(counts) exact products on both sides, in different orders
    acc_bound = 2 * max(counts) * 2.0**-24 * magnitude
    excess = (got - expected).abs() - (ROUNDING_REL * expected.abs() + acc_bound)
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e}"
    for e, count in enumerate(counts):
        if count == 0:
            assert not got[e].any()  # an expert without rows: exact zeros
    # The Triton kernel on the same rows: the same row steps in the same order.
    triton_out = poisoned(len(counts), width_p, width_q)
    config = WgradConfig(block_k=64, block_out_m=block_p, block_out_n=block_q,
                         num_warps=warps, num_stages=3)
    if kind.startswith("W2"):
        w2_wgrad(a, b, po, ro, triton_out, accumulate=False, config=config)
    else:
        w13_wgrad(a, b_src, po, ro, triton_out.view(len(counts), 2, ffn, hidden),
                  x_offset=b_offset, accumulate=False, config=config)
    diff = (got - triton_out.float()).abs().max().item()
    assert diff <= ROUNDING_REL * triton_out.float().abs().max().item(), diff
    # Through the public entry point with gluon=True: the same bits as the direct launch
    # (one program per SM here, so a different tile walk, same per-tile sums).
    via = poisoned(len(counts), width_p, width_q)
    gconfig = WgradConfig(block_k=block_k, block_out_m=block_p, block_out_n=block_q,
                          num_warps=warps, num_stages=stages, gluon=True)
    if kind.startswith("W2"):
        w2_wgrad(a, b, po, ro, via, accumulate=False, config=gconfig)
    else:
        w13_wgrad(a, b_src, po, ro, via.view(len(counts), 2, ffn, hidden),
                  x_offset=b_offset, accumulate=False, config=gconfig)
    assert same_bits(via, out)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "pp"])
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("cfg", _gluon_configs(), ids=lambda c: "x".join(map(str, c)))
def test_gluon_wgrad_x_rows(cfg, programs, form):
    """The warp-specialised Gluon W13 WGRAD reading x's rows in place through the gather
    table (``cp.async`` by address: :func:`kept_x_rows`'s null rows, NaN behind padding
    addresses and around x) gives the same bits as the same kernel over the rows stored in
    order (TMA), and so does the public entry point (one program per SM)."""
    from distmoe.kernels.wgrad.gluon import launch_gluon_wgrad

    block_p, block_q, stages, warps, block_k = cfg
    pingpong = form == "pp"
    if block_q > 128:
        pytest.skip("the warp-specialised kernel takes block_q <= 128")
    if pingpong and (warps != 4 or block_p != 128):
        pytest.skip("the ping-pong form takes warpgroups of 4 warps over 128 rows")
    counts = [0, 37, 64, 200, 1, 128, 301, 0, 75, 48]
    layout = layout_from_counts(counts, 128, idle_tiles=1)
    big = [e + 1 for e, c in enumerate(counts[:-1]) if 0 < c < 128]
    hidden, ffn = 256, 256  # P = 512: 256-row tiles too (the heuristic's pick here)
    width_p, width_q = 2 * ffn, hidden
    a = _wgrad_operand(layout, width_p, big_experts=big)
    base, x_offset, table, origin, x_gathered, _keep = kept_x_rows(layout, hidden)
    po, ro = layout.padded_offsets, layout.row_offsets
    opts = dict(block_p=block_p, block_q=block_q, stages=stages, num_warps=warps,
                block_k=block_k, programs=programs, specialized=True, pingpong=pingpong)
    want = poisoned(len(counts), width_p, width_q)
    launch_gluon_wgrad(a, x_gathered, ro, want, **opts)
    got = poisoned(len(counts), width_p, width_q)
    launch_gluon_wgrad(a, base, ro, got, b_offset=x_offset, b_rows=table, padded_offsets=po,
                       b_rows_origin=origin, **opts)
    assert torch.isfinite(got).all(), "an output element was not written (NaN poison left)"
    assert same_bits(got, want)
    # rows stored in order, the switch set: the (null) table unread, the same bits
    ordered_base, ordered_offset = in_order_rows(x_gathered, origin)  # NaN past the live rows
    ordered = poisoned(len(counts), width_p, width_q)
    launch_gluon_wgrad(a, ordered_base, ro, ordered, b_offset=ordered_offset,
                       b_rows=torch.zeros_like(table), padded_offsets=po, b_rows_origin=origin,
                       **opts)
    assert same_bits(ordered, want)
    zeros = torch.zeros(len(counts), width_p, width_q, device=DEVICE)
    expected = w2_wgrad_ref(a, x_gathered, po, ro, zeros.clone())
    magnitude = w2_wgrad_ref(a.abs(), x_gathered.abs(), po, ro, zeros)
    excess = (got.float() - expected).abs() - (ROUNDING_REL * expected.abs()
                                               + 2 * max(counts) * 2.0**-24 * magnitude)
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e}"
    via = poisoned(len(counts), width_p, width_q)
    gconfig = WgradConfig(block_k=block_k, block_out_m=block_p, block_out_n=block_q,
                          num_warps=warps, num_stages=stages, gluon=True, specialized=True,
                          pingpong=pingpong)
    w13_wgrad(a, base, po, ro, via.view(len(counts), 2, ffn, hidden), x_offset=x_offset,
              accumulate=False, config=gconfig, x_rows=table, rows_origin=origin)
    assert same_bits(via, want)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("kind", ["W2_p_tail", "W13_x_offset"])
@pytest.mark.parametrize("form", ["wide", "pp"])
def test_gluon_wgrad_lockstep(form, kind, programs):
    """The warp-specialised WGRAD with its producers in lockstep (``lockstep=True``: each
    waits for the previous wave's loads, counted in a device counter) writes the same bits as
    without, over a NaN-poisoned output: an expert with no rows, partial steps and a partial
    last row block (P = 320), W13's B at a device offset; with 3 programs each walks many
    tiles, so a counter that never reaches a wave's need would stall (the wait is bounded)
    or mis-order nothing the bits would show. Through ``w2_wgrad`` with
    ``WgradConfig(lockstep=True)`` too. A launch with B's rows from a table refuses it."""
    from distmoe.kernels.wgrad.gluon import launch_gluon_wgrad

    block_p, warps, stages = (256, 8, 3) if form == "wide" else (128, 4, 5)
    counts = [0, 37, 64, 200, 1, 128, 301, 0, 75, 48]
    layout = layout_from_counts(counts, 128, idle_tiles=1)
    width_p, width_q = (320, 192) if kind == "W2_p_tail" else (384, 256)
    big = [e + 1 for e, c in enumerate(counts[:-1]) if 0 < c < 128]
    a = _wgrad_operand(layout, width_p, big_experts=big)
    b = _wgrad_operand(layout, width_q, big_experts=big)
    b_src, b_offset = b, None
    if kind == "W13_x_offset":
        offset = 8 * 5
        b_src = poisoned(offset + b.numel() + width_q)
        b_src[offset:offset + b.numel()] = b.reshape(-1)
        b_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    outs = []
    for lockstep in (False, True):
        out = poisoned(len(counts), width_p, width_q)
        launch_gluon_wgrad(a, b_src, layout.row_offsets, out, b_offset=b_offset,
                           block_p=block_p, block_q=128, stages=stages, num_warps=warps,
                           programs=programs, specialized=True, pingpong=form == "pp",
                           lockstep=lockstep)
        outs.append(out)
    assert torch.isfinite(outs[1].float()).all(), "an output element was not written"
    assert same_bits(outs[0], outs[1])
    if kind == "W2_p_tail":
        via = poisoned(len(counts), width_p, width_q)
        w2_wgrad(a, b, layout.padded_offsets, layout.row_offsets, via, accumulate=False,
                 config=WgradConfig(block_out_m=block_p, block_out_n=128, num_warps=warps,
                                    num_stages=stages, gluon=True, specialized=True,
                                    pingpong=form == "pp", lockstep=True))
        assert same_bits(via, outs[0])
    table = torch.zeros(int(layout.padded_offsets[-1]), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"lockstep needs specialized=True and B loaded by TMA "
                                         r"\(no b_rows\), got specialized=True and a b_rows"):
        launch_gluon_wgrad(a, b_src, layout.row_offsets, outs[0], block_p=block_p,
                           block_q=128, stages=stages, num_warps=warps, specialized=True,
                           b_rows=table, lockstep=True)


def test_gluon_wgrad_config_rules():
    # B's rows by address (x_rows): 256-row output tiles where P allows, else the usual pick
    got = rules.wgrad_gluon(out_rows=1536, out_cols=2048, rows_per_expert=256,
                                   gathered_b=True)
    assert (got.block_out_m, got.block_out_n, got.num_warps, got.num_stages, got.specialized,
            got.pingpong) == (256, 128, 8, 3, True, False)
    for rows in (256, 4096):
        assert rules.wgrad_gluon(out_rows=384, out_cols=2048, rows_per_expert=rows,
                                        gathered_b=True) == rules.wgrad_gluon(
            out_rows=384, out_cols=2048, rows_per_expert=rows)
    with pytest.raises(ValueError, match=r"gluon=True needs split_rows == 1 \(got 2\)"):
        WgradConfig(split_rows=2, gluon=True)
    with pytest.raises(ValueError, match=r"block_out_m >= 16 \* num_warps \(got 64 and 8"):
        WgradConfig(block_out_m=64, num_warps=8, gluon=True)
    with pytest.raises(TypeError, match=r"gluon must be a bool, got int"):
        WgradConfig(gluon=1)
    # the warp-specialised form: a Gluon config with at most 128 output columns
    with pytest.raises(TypeError, match=r"specialized must be a bool, got int"):
        WgradConfig(gluon=True, specialized=1)
    with pytest.raises(ValueError, match=r"specialized=True needs gluon=True \(got False\)"):
        WgradConfig(specialized=True)
    with pytest.raises(ValueError, match=r"block_out_n <= 128 \(got 256\)"):
        WgradConfig(block_out_n=256, gluon=True, specialized=True)
    # its ping-pong form: two warpgroups of 4 warps, each on a whole 128-row tile
    with pytest.raises(TypeError, match=r"pingpong must be a bool, got int"):
        WgradConfig(gluon=True, specialized=True, num_warps=4, pingpong=1)
    with pytest.raises(ValueError, match=r"pingpong=True needs specialized=True \(got False\)"):
        WgradConfig(gluon=True, num_warps=4, pingpong=True)
    with pytest.raises(ValueError, match=r"num_warps == 4 \(got 8\)"):
        WgradConfig(gluon=True, specialized=True, pingpong=True)
    with pytest.raises(ValueError, match=r"block_out_m == 128 \(got 64\)"):
        WgradConfig(block_out_m=64, gluon=True, specialized=True, num_warps=4, pingpong=True)
    # the producers in lockstep: the warp-specialised form's, off unless asked for
    with pytest.raises(TypeError, match=r"lockstep must be a bool, got int"):
        WgradConfig(gluon=True, specialized=True, lockstep=1)
    with pytest.raises(ValueError, match=r"lockstep=True needs specialized=True \(got False\)"):
        WgradConfig(gluon=True, lockstep=True)
    # the heuristic turns it on for the 256 x 128 tiles from 48 MiB an expert (DeepSeek-V3's
    # W13: 56 MiB; not its W2's 28, nor V4-Flash's or GPT-OSS-120B's 32), B loaded by TMA
    assert thresholds("h100").value("wgrad_lockstep_expert_bytes") == 2 * 4096 * 6144
    for (rows, cols), on in {(4096, 7168): True, (4096, 6144): True, (4096, 6016): False,
                             (7168, 2048): False, (4096, 4096): False, (5760, 2880): False,
                             (8192, 3072): True}.items():
        got = rules.wgrad_gluon(out_rows=rows, out_cols=cols, rows_per_expert=128)
        assert (got.block_out_m, got.lockstep) == (256, on), (rows, cols)
        gathered = rules.wgrad_gluon(out_rows=rows, out_cols=cols, rows_per_expert=128,
                                            gathered_b=True)
        assert not gathered.lockstep, (rows, cols)
    # what the Hopper heuristic picks, always the specialised kernel's 128-column tile: 256
    # output rows (8 warps, 3 stages) where an expert's gradient holds >= 12 MiB, at any row
    # count; else its ping-pong form below 1024 rows per expert or for narrow outputs, its two
    # cooperating warpgroups (8 warps, 5 stages) from 1024 rows per expert with outputs >= 256
    # wide
    pick = rules.wgrad_gluon

    def form(c):
        return (c.block_out_m, c.block_out_n, c.gluon, c.specialized, c.pingpong, c.num_warps,
                c.num_stages)

    pingpong, cooperative = (128, 128, True, True, True, 4, 5), (128, 128, True, True, False, 8, 5)
    wide = (256, 128, True, True, False, 8, 3)
    assert form(pick(out_rows=2048, out_cols=768, rows_per_expert=256)) == pingpong  # 3 MiB
    assert form(pick(out_rows=2048, out_cols=768, rows_per_expert=1023)) == pingpong
    assert form(pick(out_rows=2048, out_cols=128, rows_per_expert=2048)) == pingpong
    assert form(pick(out_rows=1536, out_cols=2048, rows_per_expert=1024)) == cooperative  # 6 MiB
    assert form(pick(out_rows=2048, out_cols=2048, rows_per_expert=2048)) == cooperative  # 8 MiB
    for rows in (96, 128, 1024, 2048, None):  # 16 MiB: T=8192 D=4096 F=2048 E=32's W2
        assert form(pick(out_rows=4096, out_cols=2048, rows_per_expert=rows)) == wide
    assert form(pick(out_rows=4096, out_cols=7168, rows_per_expert=128)) == wide  # DeepSeek-V3
    # the 12 MiB line, and the tile's 256 rows and 128 columns
    assert form(pick(out_rows=3072, out_cols=2048, rows_per_expert=128)) == wide
    assert form(pick(out_rows=3064, out_cols=2048, rows_per_expert=128)) == pingpong
    assert form(pick(out_rows=248, out_cols=32768, rows_per_expert=128)) == pingpong
    assert form(pick(out_rows=65536, out_cols=96, rows_per_expert=128)) == pingpong
    # P not a multiple of the tile (GPT-OSS: D = 2880, 15.8 MiB per expert): the same picks,
    # the last row block stored clipped; below 128 rows or off TMA's 16-byte pitch, the
    # Triton kernel
    assert form(pick(out_rows=2880, out_cols=2880, rows_per_expert=128)) == wide
    assert form(pick(out_rows=4000, out_cols=2048, rows_per_expert=2048)) == wide
    assert form(pick(out_rows=2000, out_cols=2048, rows_per_expert=2048)) == cooperative
    # an HBM3e-class device (H200: 140.4 GiB as torch reports it; H100: 79.6): the 256 x 128
    # tiles from 1024 rows per expert only, ping-pong below (and no lockstep); a device of
    # unknown memory or no row hint keeps the H100's rule
    from distmoe.kernels.base.device import device_memory_bytes
    from distmoe.plan.thresholds import HBM3E_MEMORY_BYTES

    h200, h100 = 143771 * 2**20, 81559 * 2**20
    assert h100 < HBM3E_MEMORY_BYTES <= h200
    for rows, cols in ((4096, 7168), (7168, 2048), (5760, 2880), (4096, 4096)):
        for hint, want in ((96, pingpong), (128, pingpong), (1023, pingpong), (1024, wide),
                           (2048, wide), (None, wide)):
            got = pick(out_rows=rows, out_cols=cols, rows_per_expert=hint, device_class="h200")
            assert form(got) == want, (rows, cols, hint)
            assert not got.lockstep or hint is None or hint >= 1024, (rows, cols, hint)
            assert pick(out_rows=rows, out_cols=cols, rows_per_expert=hint,
                        device_class="h100") == pick(out_rows=rows, out_cols=cols,
                                                    rows_per_expert=hint), (rows, cols, hint)
    assert pick(out_rows=4096, out_cols=7168, rows_per_expert=1024, device_class="h200").lockstep
    # below 12 MiB the device changes nothing
    for hint in (128, 2048):
        assert pick(out_rows=2048, out_cols=2048, rows_per_expert=hint, device_class="h200") \
            == pick(out_rows=2048, out_cols=2048, rows_per_expert=hint)
    # the heuristic reads the device's memory from the driver; no device, a CPU one: unknown
    assert device_memory_bytes(None) is None and device_memory_bytes("cpu") is None
    if torch.cuda.is_available():
        assert device_memory_bytes("cuda") == torch.cuda.get_device_properties(0).total_memory
        if device_class("cuda") != "generic":  # on a Hopper GPU the plan keys on its memory
            assert rules.wgrad_config(
                out_rows=4096, out_cols=7168, rows_per_expert=128,
                device_class=device_class(torch.device("cuda"))) == pick(
                out_rows=4096, out_cols=7168, rows_per_expert=128,
                device_class=device_class(torch.device("cuda")))
    assert pick(out_rows=4004, out_cols=2048, rows_per_expert=2048) is None
    assert pick(out_rows=120, out_cols=2048, rows_per_expert=2048) is None
    # through the device heuristic the same picks; without a Hopper device, Triton's
    assert rules.wgrad_config(out_rows=4096, out_cols=2048, rows_per_expert=128) \
        == rules.wgrad_config(out_rows=4096, out_cols=2048, rows_per_expert=128,
                                      device_class=device_class("cpu"))
    assert not rules.wgrad_config(out_rows=4096, out_cols=2048,
                                          rows_per_expert=128).gluon
