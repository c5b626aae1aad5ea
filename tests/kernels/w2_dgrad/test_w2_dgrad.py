"""W2 DGRAD + SwiGLU backward (Triton and Gluon) against the plain-PyTorch reference.

Layouts, poisoning and tolerances: :mod:`backward_cases` (tests/kernels/backward_cases.py).
"""

import math
from dataclasses import replace

import pytest
import torch
from backward_cases import (
    DEVICE,
    act_rows,
    assert_bf16_close,
    assert_walks_several_tiles,
    build_layout,
    layout_from_counts,
    make_ids,
    poisoned,
    row_table,
    same_bits,
)

from distmoe.kernels.w2_dgrad.config import W2DgradConfig
from distmoe.kernels.w2_dgrad.triton import w2_dgrad_swiglu_bwd, w2_dgrad_swiglu_bwd_ref
from distmoe.plan import device_class, rules


def _w2_problem(hidden, ffn, block_m, *, one_expert=False):
    """Expert 3 gets no routes (no segment); expert 1 gets a whole extra tile of padding rows;
    one live row has a null table entry; h1 rows that must not be read are NaN."""
    num_experts, num_tokens, top_k, t_max = 4, 11, 3, 12
    experts = [2] if one_expert else [0, 1, 2]
    ids = make_ids(num_tokens, top_k, experts)
    layout = build_layout(ids, num_experts, block_m, extra_tiles={1: 1})
    combine = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    route = layout.route_of_row.to(DEVICE)
    unrouted = torch.ones(combine.shape[0], dtype=torch.bool, device=DEVICE)
    unrouted[route[route >= 0]] = False
    combine[unrouted] = float("nan")  # rows no live table entry names: never read
    null_rows = torch.zeros(layout.num_rows, dtype=torch.bool)
    null_rows[layout.is_live.nonzero()[1]] = True  # one live row with a null address
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    h1 = torch.randn(layout.num_act, 2 * ffn, device=DEVICE).bfloat16() * 2
    h1[~layout.live_act()] = float("nan")  # spare rows past the live end: never read
    h1[layout.act_of_row[null_rows].to(DEVICE)] = float("nan")  # null rows: never read
    # Padding and idle entries point at a (NaN) row of combine that no live entry names.
    canary = unrouted.nonzero()[0].item()
    ptrs = row_table(layout, combine, canary=combine[canary : canary + 1], null_rows=null_rows)
    return layout, combine, w2, h1, ptrs, null_rows


@pytest.mark.parametrize(
    "mode",
    [
        "gather_once",  # grad_h3_out given: row gather launch, then TMA-fed GEMM
        "gather_in_loop",  # no grad_h3_out: pointer gather inside the K loop
        "in_place",  # grad_h1_out is h1
        "one_expert",  # every route to one expert
        "grad_h1_only",  # neither h2_out nor grad_h3_out
        "narrow_tiles",  # block_n 16: the epilogue without column halves
        "wide",  # block_n 256: the epilogue in four column parts (F = 200: the last masked)
        "device_descriptors",  # TMA descriptors built in the kernel, not on the host
    ],
)
def test_w2_dgrad_swiglu_bwd(mode):
    hidden, block_m = 48, 16  # D and F not multiples of the tiles: masked tails
    ffn = 200 if mode == "wide" else 40
    layout, combine, w2, h1, ptrs, null_rows = _w2_problem(
        hidden, ffn, block_m, one_expert=mode == "one_expert"
    )
    num_act = layout.num_act
    h1_saved = h1.clone()
    grad_h1 = h1 if mode == "in_place" else poisoned(num_act, 2 * ffn)
    h2 = None if mode == "grad_h1_only" else poisoned(num_act, ffn)
    grad_h3 = None if mode in ("gather_in_loop", "grad_h1_only") else poisoned(num_act, hidden)
    block_n = {"narrow_tiles": 16, "wide": 256}.get(mode, 32)
    config = W2DgradConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=min(block_n, 32),
        num_warps=4,
        group_m=2,
        host_descriptors=mode != "device_descriptors",
    )

    w2_dgrad_swiglu_bwd(
        ptrs,
        layout.padded_offsets,
        layout.row_offsets,
        w2,
        h1,
        grad_h1,
        h2_out=h2,
        grad_h3_out=grad_h3,
        config=config,
    )

    ref_grad_h1, ref_h2, ref_grad_h3 = w2_dgrad_swiglu_bwd_ref(
        ptrs, layout.padded_offsets, layout.row_offsets, w2, h1_saved, row_sources=[combine]
    )
    live = layout.live_act()
    spare = ~live
    num_spare = int(spare.sum())
    assert num_spare > 0
    # grad_h1 and h2: an fp32 GEMM plus fp32 SwiGLU terms, rounded to bf16 once.
    assert_bf16_close(grad_h1[live], ref_grad_h1[live])
    if mode == "in_place":
        assert same_bits(grad_h1[spare], h1_saved[spare])
    else:
        assert same_bits(grad_h1[spare], poisoned(num_spare, 2 * ffn))
    null = layout.act_of_row[null_rows].to(DEVICE)
    assert (grad_h1[null] == 0).all()
    if h2 is not None:
        assert_bf16_close(h2[live], ref_h2[live])
        assert (h2[null] == 0).all()
        assert same_bits(h2[spare], poisoned(num_spare, ffn))
    if grad_h3 is not None:  # data movement: bit-exact, zeros for null rows
        assert same_bits(grad_h3[live], ref_grad_h3[live].bfloat16())
        assert same_bits(grad_h3[spare], poisoned(num_spare, hidden))


def _run_w2_dgrad(layout, ptrs, w2, h1_arg, grad_h1_out, config, *, gather_once,
                  h1_offset=None):
    """One w2_dgrad_swiglu_bwd into NaN-poisoned h2 (and grad_h3 when gathering once);
    returns (grad_h1_out, h2, grad_h3)."""
    num_act, ffn = layout.num_act, w2.shape[2]
    h2 = poisoned(num_act, ffn)
    grad_h3 = poisoned(num_act, w2.shape[1]) if gather_once else None
    w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1_arg,
                        grad_h1_out, h1_offset=h1_offset, h2_out=h2, grad_h3_out=grad_h3,
                        config=config)
    return grad_h1_out, h2, grad_h3


@pytest.mark.parametrize("gather_once", [True, False])
def test_w2_dgrad_h1_offset(gather_once):
    """h1 at a device-side offset into a 1-D base, out of place and in place (grad_h1_out
    over the very h1 rows): bit-exact equal to the plain 2-D path (same kernel arithmetic)."""
    hidden, ffn, block_m = 48, 40, 16
    # combine must outlive the launches: ptrs point into it.
    layout, combine, w2, h1, ptrs, _ = _w2_problem(hidden, ffn, block_m)
    num_act = layout.num_act
    config = W2DgradConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4, group_m=2)
    outs = {}

    def run(name, h1_arg, grad_h1_out, h1_offset=None):
        grad_h1_out, h2, grad_h3 = _run_w2_dgrad(
            layout, ptrs, w2, h1_arg, grad_h1_out, config, gather_once=gather_once,
            h1_offset=h1_offset)
        outs[name] = (grad_h1_out.clone(), h2, grad_h3)

    run("plain", h1, poisoned(num_act, 2 * ffn))
    offset = 8 * 7  # elements: 16-byte aligned, not a multiple of a row (2F = 80)
    base = torch.randn(offset + num_act * 2 * ffn + 24, device=DEVICE).bfloat16()
    base[offset : offset + num_act * 2 * ffn] = h1.reshape(-1)
    base_before = base.clone()
    h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    run("offset", base, poisoned(num_act, 2 * ffn), h1_offset)
    assert same_bits(base, base_before)  # out of place: the base is only read
    rows_view = base[offset : offset + num_act * 2 * ffn].view(num_act, 2 * ffn)
    run("in_place", base, rows_view, h1_offset)

    live = layout.live_act()
    for name in ("offset", "in_place"):
        for got, want in zip(outs[name][1:], outs["plain"][1:], strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert same_bits(got, want)
    assert same_bits(outs["offset"][0], outs["plain"][0])
    assert same_bits(outs["in_place"][0][live], outs["plain"][0][live])
    # In place: the base outside the live rows keeps its bits (spare rows, lead, tail).
    expected = base_before.clone()
    expected[offset : offset + layout.live_end * 2 * ffn] = outs["plain"][0][live].reshape(-1)
    assert same_bits(base, expected)


@pytest.mark.parametrize("persistent", [False, True])
def test_w2_dgrad_pre_gathered_rows(persistent):
    """grad_h3_rows (rows pushed there by their owners): nothing is gathered or written
    there, and every output is bit-exact equal to the gather-once path's."""
    hidden, ffn, block_m = 48, 40, 16
    layout, combine, w2, h1, ptrs, _ = _w2_problem(hidden, ffn, block_m)
    num_act = layout.num_act
    config = W2DgradConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4, group_m=2,
                           persistent=persistent)
    grad_h1, h2, grad_h3 = _run_w2_dgrad(layout, ptrs, w2, h1, poisoned(num_act, 2 * ffn),
                                         config, gather_once=True)
    rows = grad_h3.clone()
    live = layout.live_act()
    rows[~live] = 0.0  # the rows a push never writes: zeros (NaN would reach no output either)
    rows_before = rows.clone()
    got_h1, got_h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
    w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, got_h1,
                        h2_out=got_h2, grad_h3_rows=rows, config=config)
    assert same_bits(rows, rows_before)  # read only
    assert same_bits(got_h1, grad_h1) and same_bits(got_h2, h2)
    # gluon=True where the Gluon kernel cannot run (the interpreter, 16-row tiles): a warning
    # that says why, then the Triton kernel, the same bits
    gluon_cfg = replace(config, gluon=True)
    for kwargs in (dict(grad_h3_rows=rows), dict(grad_h3_out=poisoned(num_act, hidden))):
        w_h1, w_h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        with pytest.warns(RuntimeWarning, match=r"w2_dgrad_swiglu_bwd: config\.gluon is set, "
                                                r"but the Gluon kernel cannot run this call"):
            w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, w_h1,
                                h2_out=w_h2, config=gluon_cfg, **kwargs)
        assert same_bits(w_h1, grad_h1) and same_bits(w_h2, h2)
    with pytest.raises(ValueError, match="grad_h3_out and grad_h3_rows exclude each other"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, got_h1,
                            grad_h3_out=poisoned(num_act, hidden), grad_h3_rows=rows)
    with pytest.raises(ValueError, match="grad_h3_rows"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, got_h1,
                            grad_h3_rows=rows[:-1])


def _scored_problem(hidden, ffn, block_m):
    """The W2 DGRAD problem of :func:`_w2_problem` in the layer's scored form: unscaled
    grad_h3 rows pre-gathered in activation rows (spare rows NaN, the null row zeros), each
    route's fp32 score at the start of its (otherwise poisoned) route row, which the table
    points at. Returns (layout, w2, h1, ptrs, route_rows, rows, row_scores, ref_ptrs,
    g_routes)."""
    layout, _, w2, h1, _, null_rows = _w2_problem(hidden, ffn, block_m)
    n_routes = 12 * 3  # t_max * top_k of _w2_problem
    g_routes = torch.randn(n_routes, hidden, device=DEVICE).bfloat16()
    scores = torch.rand(n_routes, device=DEVICE) + 0.25
    route_rows = poisoned(n_routes, hidden)
    route_rows.view(torch.float32)[:, 0] = scores
    canary = poisoned(1, hidden)  # padding and idle entries: never used
    ptrs = row_table(layout, route_rows, canary=canary, null_rows=null_rows)
    ref_ptrs = row_table(layout, g_routes, null_rows=null_rows)
    rows = act_rows(layout, g_routes)  # route_of_act indexes g_routes (top_k=1)
    null_act = layout.act_of_row[null_rows].to(DEVICE)
    rows[null_act] = 0.0
    route = layout.route_of_act.to(DEVICE)
    row_scores = torch.where(route >= 0, scores[route.clamp(min=0)], 0.0)
    return layout, w2, h1, ptrs, route_rows, rows, row_scores, ref_ptrs, g_routes, null_act, canary


@pytest.mark.parametrize("block_n,persistent", [(32, False), (32, True), (256, False), (16, False)],
                         ids=["halves", "halves_persistent", "eighths", "one_part"])
def test_w2_dgrad_scored_rows(block_n, persistent):
    """scored_rows: grad_h1 and h2 are the SwiGLU backward of score * (g @ W2) and score * h2;
    each live non-null route row receives one fp32 part per column tile after its score; the
    score, the rest of the route rows, spare rows and the canary keep their bits."""
    hidden, block_m = 48, 16
    ffn = 200 if block_n == 256 else 40  # masked tails in the last column tile
    (layout, w2, h1, ptrs, route_rows, rows, row_scores, ref_ptrs, g_routes, null_act,
     canary) = _scored_problem(hidden, ffn, block_m)
    num_act, num_parts = layout.num_act, -(-ffn // block_n)
    config = W2DgradConfig(block_m=block_m, block_n=block_n, block_k=min(block_n, 32),
                           num_warps=4, group_m=2, persistent=persistent)
    before = route_rows.clone()
    rows_before, canary_before = rows.clone(), canary.clone()
    grad_h1, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
    w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                        h2_out=h2, grad_h3_rows=rows, scored_rows=True, config=config)

    ref_h1, ref_h2, _, ref_parts = w2_dgrad_swiglu_bwd_ref(
        ref_ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, row_sources=[g_routes],
        row_scores=row_scores, block_n=block_n)
    live = layout.live_act()
    assert_bf16_close(grad_h1[live], ref_h1[live])
    assert_bf16_close(h2[live], ref_h2[live])
    assert (grad_h1[null_act] == 0).all() and (h2[null_act] == 0).all()
    assert same_bits(grad_h1[~live], poisoned(int((~live).sum()), 2 * ffn))
    assert same_bits(rows, rows_before) and same_bits(canary, canary_before)
    # parts: fp32 sums of up to block_n products of the fp32 GEMM result with bf16(h2); the
    # kernel's and torch's sigmoid may round h2 to neighbouring bf16 values: 2^-8 of the
    # largest part bounds that, far below what a wrong row, column or scale gives
    values = route_rows.view(torch.float32)
    expected = before.view(torch.float32).clone()
    route = layout.route_of_act.to(DEVICE)
    has_part = live.clone()
    has_part[null_act] = False
    got = values[route[has_part]][:, 1 : 1 + num_parts]
    want = ref_parts[has_part]
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    assert ((got - want).abs() <= 2.0**-8 * scale).all(), (got - want).abs().max().item()
    expected[route[has_part], 1 : 1 + num_parts] = got
    assert same_bits(values, expected)  # scores and everything past the parts: untouched

    with pytest.raises(ValueError, match="scored_rows needs grad_h3_rows"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                            grad_h3_out=poisoned(num_act, hidden), scored_rows=True)
    with pytest.raises(TypeError, match="scored_rows must be a bool, got int"):
        w2_dgrad_swiglu_bwd(ptrs, layout.padded_offsets, layout.row_offsets, w2, h1, grad_h1,
                            grad_h3_rows=rows, scored_rows=1)


@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
@pytest.mark.parametrize("gather_once", [True, False], ids=["gather_once", "gather_in_loop"])
def test_w2_dgrad_persistent(gather_once, host_descriptors):
    """persistent=True is bit-identical to one program per tile (every tile is computed the
    same way; only the order and the program differ): plain h1, and h1 at a device-side offset
    in place (the offset is read once per persistent program). Poison outside the live rows
    stays, the padding tile, the empty expert and the idle tiles are skipped."""
    hidden, ffn, block_m, block_n = 48, 40, 16, 32
    layout, combine, w2, h1, ptrs, null_rows = _w2_problem(hidden, ffn, block_m)
    num_act = layout.num_act
    h1_saved = h1.clone()
    live_tiles = int(layout.padded_offsets[-1]) // block_m * math.ceil(ffn / block_n)
    configs = {
        persistent: W2DgradConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=4,
                                  group_m=2, persistent=persistent,
                                  host_descriptors=host_descriptors)
        for persistent in (False, True)
    }
    assert_walks_several_tiles(
        configs[True], layout.num_rows // block_m * math.ceil(ffn / block_n), live_tiles
    )

    def run(persistent, h1_arg, grad_h1_out, h1_offset=None):
        return _run_w2_dgrad(layout, ptrs, w2, h1_arg, grad_h1_out, configs[persistent],
                             gather_once=gather_once, h1_offset=h1_offset)

    tiles = run(False, h1, poisoned(num_act, 2 * ffn))
    walked = run(True, h1, poisoned(num_act, 2 * ffn))
    for got, want in zip(walked, tiles, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert same_bits(got, want)  # poisoned spare rows included
    assert same_bits(h1, h1_saved)  # out of place: h1 is only read

    # The persistent outputs themselves: against the reference, poison kept past the live end.
    ref_grad_h1, ref_h2, ref_grad_h3 = w2_dgrad_swiglu_bwd_ref(
        ptrs, layout.padded_offsets, layout.row_offsets, w2, h1_saved, row_sources=[combine]
    )
    live, spare = layout.live_act(), ~layout.live_act()
    num_spare = int(spare.sum())
    grad_h1, h2, grad_h3 = walked
    assert_bf16_close(grad_h1[live], ref_grad_h1[live])
    assert_bf16_close(h2[live], ref_h2[live])
    assert same_bits(grad_h1[spare], poisoned(num_spare, 2 * ffn))
    assert same_bits(h2[spare], poisoned(num_spare, ffn))
    assert (grad_h1[layout.act_of_row[null_rows].to(DEVICE)] == 0).all()
    if gather_once:
        assert same_bits(grad_h3[live], ref_grad_h3[live].bfloat16())
        assert same_bits(grad_h3[spare], poisoned(num_spare, hidden))

    # h1 at a device-side offset, grad_h1 in place over those rows.
    offset = 8 * 7  # elements: 16-byte aligned, not a multiple of a row (2F = 80)
    base = torch.randn(offset + num_act * 2 * ffn + 24, device=DEVICE).bfloat16()
    base[offset : offset + num_act * 2 * ffn] = h1_saved.reshape(-1)
    base_before = base.clone()
    rows_view = base[offset : offset + num_act * 2 * ffn].view(num_act, 2 * ffn)
    h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    _, h2_in_place, grad_h3_in_place = run(True, base, rows_view, h1_offset)
    assert same_bits(h2_in_place, tiles[1])
    if gather_once:
        assert same_bits(grad_h3_in_place, tiles[2])
    expected = base_before.clone()
    expected[offset : offset + layout.live_end * 2 * ffn] = tiles[0][live].reshape(-1)
    assert same_bits(base, expected)  # live rows: the gradients; all else keeps its bits


def _gluon_dgrad_problem(hidden, ffn, block, scale=1):
    """The Gluon W2 DGRAD tests' rows: experts with no rows, one row, partial and whole tiles,
    a whole tile of padding rows, an idle tile, a null live row (expert 2; its grad_h3 row
    zeros, its h1 row NaN: never read); spare rows NaN. ``scale`` multiplies every expert's
    rows. Returns (layout, live, w2, rows, h1, null_rows, null_act)."""
    counts = [scale * n for n in (0, 37, 128, 300, 1, 129, 0, 75)]
    layout = layout_from_counts(counts, block, idle_tiles=1, extra_tiles={2: 1})
    num_experts, num_act = len(counts), layout.num_act
    live = layout.live_act()
    w2 = (torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(hidden)).bfloat16()
    rows = torch.randn(num_act, hidden, device=DEVICE).bfloat16()
    rows[~live] = float("nan")  # spare rows: their products are never stored
    h1 = torch.randn(num_act, 2 * ffn, device=DEVICE).bfloat16() * 2
    h1[~live] = float("nan")
    null_rows = torch.zeros(layout.num_rows, dtype=torch.bool)
    null_rows[layout.is_live.nonzero()[40]] = True
    null_act = layout.act_of_row[null_rows].to(DEVICE)
    rows[null_act] = 0.0  # what a push leaves there: zeros (finite at least)
    h1[null_act] = float("nan")
    return layout, live, w2, rows, h1, null_rows, null_act


def _assert_one_rounding_apart(got, want, live, null_act, *, spare_poisoned=True):
    """Gluon against Triton: live rows within one bf16 rounding of each other (the kernels
    compute the sigmoid differently), null rows exact zeros, spare rows still poison."""
    g, w = got[live].double(), want[live].double()
    assert torch.isfinite(g).all()
    scale = w.abs().max().item()
    assert ((g - w).abs() <= 2.0**-7 * w.abs() + 1e-3 * scale).all(), (g - w).abs().max().item()
    assert (got[null_act] == 0).all()
    if spare_poisoned:
        assert same_bits(got[~live], poisoned(int((~live).sum()), got.shape[1]))


def _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1, out, h2, *, h1_offset=None,
                              scored_rows=False, **launch):
    """One W2 DGRAD on the pre-gathered ``rows``: the Gluon kernel launched directly
    (``launch``: its ring depth, its grid) or, as the reference, the Triton kernel at
    128 x 128 x 64 tiles; then a device synchronisation."""
    from distmoe.kernels.w2_dgrad.gluon import launch_gluon_w2_dgrad

    if gluon:
        launch_gluon_w2_dgrad(ptrs, po, ro, w2, rows, h1, out, h1_offset=h1_offset, h2_out=h2,
                              scored_rows=scored_rows, **launch)
    else:
        cfg = W2DgradConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
        w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, h1_offset=h1_offset, h2_out=h2,
                            grad_h3_rows=rows, scored_rows=scored_rows, config=cfg)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("stages", [4, 6])
@pytest.mark.parametrize("h1_mode", ["plain", "offset_in_place"])
def test_gluon_w2_dgrad(programs, stages, h1_mode):
    """The warp-specialised Gluon W2 DGRAD against the Triton kernel on the same pre-gathered
    rows: experts with no rows, one row, partial and whole tiles, a whole tile of padding rows,
    an idle tile, a null live row; 3 programs walk many tiles each (both consumers take turns
    many times; the ring's phases wrap). grad_h1 and h2 agree within one bf16 rounding of each
    other (the two kernels compute the sigmoid differently); null rows get exact zeros; spare
    rows past the live end keep their poison."""
    from distmoe.kernels.w2_dgrad.gluon import gluon_w2_dgrad_reason

    hidden, ffn, block = 256, 384, 128
    assert gluon_w2_dgrad_reason(DEVICE, hidden=hidden, ffn=ffn, block_m=block,
                                 block_n=128, block_k=64) is None
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block)
    num_act = layout.num_act
    ptrs = row_table(layout, rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets

    def run(gluon):
        h2 = poisoned(num_act, ffn)
        if h1_mode == "plain":
            h1_arg, out, h1_offset = h1, poisoned(num_act, 2 * ffn), None
        else:
            offset = 8 * 3  # elements: 16-byte aligned, not a multiple of a row
            h1_arg = poisoned(offset + h1.numel() + 16)
            h1_arg[offset:offset + h1.numel()] = h1.reshape(-1)
            out = h1_arg[offset:offset + h1.numel()].view(num_act, 2 * ffn)  # in place
            h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
        _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1_arg, out, h2,
                                  h1_offset=h1_offset, stages=stages, programs=programs)
        return out.clone(), h2

    want_h1, want_h2 = run(False)
    got_h1, got_h2 = run(True)
    for got, want in ((got_h1, want_h1), (got_h2, want_h2)):
        _assert_one_rounding_apart(got, want, live, null_act,
                                   spare_poisoned=h1_mode == "plain" or got is got_h2)
    # through the launcher: config.gluon picks the Gluon kernel (same bits as the direct call)
    cfg = W2DgradConfig(block_m=block, block_n=128, block_k=64, num_stages=stages, gluon=True)
    out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
    w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, h2_out=h2, grad_h3_rows=rows, config=cfg)
    if h1_mode == "plain":
        assert same_bits(out, got_h1) and same_bits(h2, got_h2)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["pingpong", "split"])
@pytest.mark.parametrize("scored", [False, True], ids=["plain", "scored"])
def test_gluon_w2_dgrad_partial_column_tile(split, scored):
    """F = 320, not a multiple of the 128-column tiles (as GPT-OSS's 2880): each row's last
    tile is partial (its weight columns past F TMA zeros, its quarters past F loading and
    storing nothing). Against the Triton kernel at the same tiles: grad_h1 and h2 within one
    bf16 rounding, null rows zeros, spare rows poisoned (a store past F lands in the row's
    u half or the next row, which the comparison shows); scored, the three score parts (the
    last over 64 columns) within 2^-8 of the largest. Ping-pong and split kernels, 3
    programs."""
    hidden, ffn, block = 256, 320, 128
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block)
    num_act = layout.num_act
    route_rows, before = _scored_route_rows(layout, hidden)
    ptrs = row_table(layout, route_rows if scored else rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets
    launch = {"epilogue_warps": 8} if split else {}

    def run(gluon):
        route_rows.copy_(before)
        out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1, out, h2,
                                  scored_rows=scored, programs=3, **launch)
        return out, h2, route_rows.clone()

    want = run(False)
    got = run(True)
    for g, w in zip(got[:2], want[:2], strict=True):
        _assert_one_rounding_apart(g, w, live, null_act)
    if scored:
        route = layout.route_of_act.to(DEVICE)
        has_part = live.clone()
        has_part[null_act] = False
        got_p, want_p = (r.view(torch.float32)[route[has_part]][:, 1:4] for r in (got[2],
                                                                              want[2]))
        assert torch.isfinite(got_p).all() and want_p[:, 2].abs().max() > 0
        assert ((got_p - want_p).abs() <= 2.0**-8 * want_p.abs().max()).all()


def _scored_route_rows(layout, hidden):
    """Poisoned bf16 route rows ``[routes, hidden]`` of ``layout``, each with its score (in
    [0.25, 1.25)) as the fp32 at its start, as the scored W2 DGRAD reads them; and a copy."""
    n_routes = int(layout.route_of_row.max()) + 1
    route_rows = poisoned(n_routes, hidden)
    route_rows.view(torch.float32)[:, 0] = torch.rand(n_routes, device=DEVICE) + 0.25
    return route_rows, route_rows.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None], ids=["3_programs", "one_per_sm"])
@pytest.mark.parametrize("reload", [None, True], ids=["bounds_default", "bounds_reloaded"])
def test_gluon_w2_dgrad_scored(programs, reload):
    """scored_rows in the Gluon W2 DGRAD against the Triton kernel (same contract): grad_h1
    and h2 within one bf16 rounding of each other, the score parts within 2^-8 of the
    largest, written only after the scores of live non-null routes; nothing else of the
    route rows changes. ``reload``: the consumers load the per-expert bounds per tile (the
    default above 32 experts; this problem has fewer)."""
    hidden, ffn, block = 256, 384, 128
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block)
    num_act = layout.num_act
    route_rows, before = _scored_route_rows(layout, hidden)
    ptrs = row_table(layout, route_rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets

    def run(gluon):
        route_rows.copy_(before)
        out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        launch = {} if reload is None else {"reload_bounds": reload}
        _gluon_or_reference_dgrad(gluon, ptrs, po, ro, w2, rows, h1, out, h2,
                                  scored_rows=True, programs=programs, **launch)
        return out, h2, route_rows.clone()

    want_h1, want_h2, want_rows = run(False)
    got_h1, got_h2, got_rows = run(True)
    for got, want in ((got_h1, want_h1), (got_h2, want_h2)):
        _assert_one_rounding_apart(got, want, live, null_act)
    parts = ffn // 128
    route = layout.route_of_act.to(DEVICE)
    has_part = live.clone()
    has_part[null_act] = False
    got_p = got_rows.view(torch.float32)[route[has_part]][:, 1:1 + parts]
    want_p = want_rows.view(torch.float32)[route[has_part]][:, 1:1 + parts]
    assert torch.isfinite(got_p).all()
    assert ((got_p - want_p).abs() <= 2.0**-8 * want_p.abs().max()).all()
    expected = before.view(torch.float32).clone()
    expected[route[has_part], 1:1 + parts] = got_p
    assert same_bits(got_rows.view(torch.float32), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("warps,buffers,stages",
                         [(4, 1, 5), (8, 1, 5), (8, 1, 4), (8, 2, 3)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("form", ["scored", "offset_in_place"])
def test_gluon_w2_dgrad_split_epilogue(warps, buffers, stages, form):
    """The split kernel (one MMA warpgroup handing each fp32 tile to an epilogue partition of
    ``epilogue_warps`` warps through ``epilogue_buffers`` shared-memory tiles) gives the same
    bits as the ping-pong kernel; 3 programs walk many tiles, so each buffer is reused and
    its barriers change phase many times."""
    _same_bits_as_the_ping_pong_kernel(form, dict(num_stages=stages, epilogue_warps=warps,
                                                  epilogue_buffers=buffers))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["pingpong", "split"])
@pytest.mark.parametrize("programs", [3, None, "twice_the_sms"])
def test_gluon_w2_dgrad_lockstep(split, programs):
    """``W2DgradConfig.lockstep`` (the TMA producer waits on a device counter for the wave
    before each tile) gives the ping-pong kernel's bits without it, scored, in both kernels:
    few programs walking many tiles (the last wave's idle programs must not hold the others'
    waits), one per SM, and twice as many programs as SMs asked for over ten times the rows
    (the grid is capped at the 171 tiles, still above an H100's or H200's 132 SMs at one
    program per SM: the programs not resident at first make the others' waits miss their
    bound, after which each stops waiting)."""
    from distmoe.kernels.base.device import num_sms

    scale = 1
    if programs == "twice_the_sms":
        programs, scale = 2 * num_sms(DEVICE), 10
    fields = dict(num_stages=4, lockstep=True, **({"epilogue_warps": 8} if split else {}))
    _same_bits_as_the_ping_pong_kernel("scored", fields, programs=programs, scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["pingpong", "split"])
@pytest.mark.parametrize("lockstep", [False, True], ids=["free", "lockstep"])
@pytest.mark.parametrize("programs", [1, 3, None])
def test_gluon_w2_dgrad_expert_groups(split, lockstep, programs):
    """``W2DgradConfig.expert_groups`` (each expert's tiles walked column tile by column tile
    over its row blocks, one to five of them here with every expert's rows doubled) gives
    the ping-pong kernel's bits in group-M order, scored, in both kernels, free and in
    lockstep: one and three programs walking many tiles, one per SM. A tile missed or
    taken twice leaves poison or a wrong row."""
    fields = dict(num_stages=4, expert_groups=True, lockstep=lockstep,
                  **({"epilogue_warps": 8} if split else {}))
    _same_bits_as_the_ping_pong_kernel("scored", fields, programs=programs, scale=2)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None])
def test_gluon_w2_dgrad_expert_groups_many_blocks(programs):
    """The expert-group order in the form the heuristic picks at 513 to 768 rows per expert
    (split epilogue, no lockstep), every expert's rows tripled: one, two, four and eight
    128-row blocks per expert (the largest, 900 rows, past the six blocks of 768), the
    ping-pong kernel's bits, scored."""
    fields = dict(num_stages=4, expert_groups=True, epilogue_warps=8)
    _same_bits_as_the_ping_pong_kernel("scored", fields, programs=programs, scale=3)


def _same_bits_as_the_ping_pong_kernel(form, fields, *, programs=3, scale=1):
    """The Gluon W2 DGRAD with the config ``fields`` (a variant of the kernel) gives the
    ping-pong kernel's bits at 4 stages: grad_h1, h2 and, scored, the route rows' score parts;
    3 programs (or ``programs``; None: one per SM) walk many tiles, null rows give zeros,
    spare rows keep their poison. ``form``: ``scored`` (score parts written into the route
    rows) or ``offset_in_place`` (h1 at a device offset, grad_h1 written over it). Also
    through the launcher's config (scored). ``scale``: as :func:`_gluon_dgrad_problem`'s."""
    hidden, ffn, block = 256, 384, 128
    layout, live, w2, rows, h1, null_rows, null_act = _gluon_dgrad_problem(hidden, ffn, block,
                                                                           scale)
    num_act = layout.num_act
    route_rows, before = _scored_route_rows(layout, hidden)
    scored = form == "scored"
    ptrs = row_table(layout, route_rows if scored else rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets
    offset = 8 * 3  # elements: 16-byte aligned, not a multiple of a row

    def run(**launch):
        route_rows.copy_(before)
        h2 = poisoned(num_act, ffn)
        if scored:
            h1_arg, out, h1_offset = h1, poisoned(num_act, 2 * ffn), None
        else:
            h1_arg = poisoned(offset + h1.numel() + 16)
            h1_arg[offset:offset + h1.numel()] = h1.reshape(-1)
            out = h1_arg[offset:offset + h1.numel()].view(num_act, 2 * ffn)  # in place
            h1_offset = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
        _gluon_or_reference_dgrad(True, ptrs, po, ro, w2, rows, h1_arg, out, h2,
                                  h1_offset=h1_offset, scored_rows=scored, programs=programs,
                                  **launch)
        return out.clone(), h2, route_rows.clone()

    want = run(stages=4)
    launch = {("stages" if k == "num_stages" else k): v for k, v in fields.items()}
    got = run(**launch)
    for g, w in zip(got, want, strict=True):
        assert same_bits(g, w)
    assert torch.isfinite(got[0][live]).all() and (got[0][null_act] == 0).all()
    if scored:  # the score parts were written (the comparison above is not of two no-ops)
        assert not same_bits(got[2], before)
    if scored:  # through the launcher: the config's fields reach the kernel
        cfg = W2DgradConfig(block_m=block, block_n=128, block_k=64, gluon=True, **fields)
        out, h2 = poisoned(num_act, 2 * ffn), poisoned(num_act, ffn)
        route_rows.copy_(before)
        w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, h2_out=h2, grad_h3_rows=rows,
                            config=cfg, scored_rows=True)
        assert same_bits(out, got[0]) and same_bits(h2, got[1])
        assert same_bits(route_rows, got[2])


def test_w2_dgrad_split_epilogue_config_rules():
    """epilogue_warps in (0, 4, 8), epilogue_buffers in (1, 2), only with gluon, and ring +
    fp32 tiles within 7 x 32 KiB."""
    base = dict(block_m=128, block_n=128, block_k=64, gluon=True)
    cfg = W2DgradConfig(**base, num_stages=3, epilogue_warps=8, epilogue_buffers=2)
    assert (cfg.epilogue_warps, cfg.epilogue_buffers) == (8, 2)
    with pytest.raises(ValueError, match=r"epilogue_warps \(6\) must be one of \(0, 4, 8\)"):
        W2DgradConfig(**base, epilogue_warps=6)
    with pytest.raises(ValueError, match=r"epilogue_buffers \(3\) must be one of \(1, 2\)"):
        W2DgradConfig(**base, num_stages=1, epilogue_warps=8, epilogue_buffers=3)
    with pytest.raises(TypeError, match="epilogue_warps must be an int, got bool"):
        W2DgradConfig(**base, epilogue_warps=True)
    with pytest.raises(ValueError, match=r"epilogue_warps \(8\) needs gluon=True"):
        W2DgradConfig(block_m=128, block_n=128, block_k=64, epilogue_warps=8)
    with pytest.raises(ValueError, match=r"num_stages \+ 2 \* epilogue_buffers \(4 \+ 2 \* 2\) "
                                         "must be at most 7"):
        W2DgradConfig(**base, num_stages=4, epilogue_warps=8, epilogue_buffers=2)
    with pytest.raises(ValueError, match=r"num_stages \(1\) must be at least 2 with gluon"):
        W2DgradConfig(**base, num_stages=1)
    with pytest.raises(TypeError, match="lockstep must be a bool, got int"):
        W2DgradConfig(**base, lockstep=1)
    with pytest.raises(TypeError, match="expert_groups must be a bool, got int"):
        W2DgradConfig(**base, expert_groups=1)


def test_gluon_w2_dgrad_config_reaches_the_launch(monkeypatch):
    """The W2 DGRAD config's Gluon fields (ring depth, group-M, split epilogue, lockstep,
    expert groups) reach the launch, on any machine: the launcher is a recorder and the check
    admits the case; nothing is written. ``gluon=False`` calls neither."""
    import distmoe.kernels.w2_dgrad.gluon as wg

    calls = []
    monkeypatch.setattr(wg, "gluon_w2_dgrad_reason",
                        lambda device, **kw: calls.append(("reason", kw)) and None)
    monkeypatch.setattr(wg, "launch_gluon_w2_dgrad",
                        lambda *a, **kw: calls.append(("launch", kw)))
    hidden, ffn, block = 256, 384, 128
    layout, _live, w2, rows, h1, null_rows, _null_act = _gluon_dgrad_problem(hidden, ffn,
                                                                             block)
    ptrs = row_table(layout, rows, null_rows=null_rows)
    po, ro = layout.padded_offsets, layout.row_offsets
    out = poisoned(layout.num_act, 2 * ffn)
    base = dict(block_m=block, block_n=128, block_k=64, gluon=True)
    for fields in (dict(num_stages=4), dict(num_stages=5, group_m=16, epilogue_warps=8,
                                            lockstep=True), dict(num_stages=4,
                                                                 expert_groups=True)):
        calls.clear()
        w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, grad_h3_rows=rows,
                            config=W2DgradConfig(**base, **fields))
        (_, reason), (_, launch) = calls
        assert (reason["block_n"], reason["block_k"]) == (128, 64)
        assert (launch["stages"], launch["group_m"], launch["epilogue_warps"],
                launch["lockstep"], launch["expert_groups"]) == (
            fields["num_stages"], fields.get("group_m", 8), fields.get("epilogue_warps", 0),
            fields.get("lockstep", False), fields.get("expert_groups", False))
    assert same_bits(out, poisoned(layout.num_act, 2 * ffn))  # the recorder launched nothing
    calls.clear()
    w2_dgrad_swiglu_bwd(ptrs, po, ro, w2, h1, out, grad_h3_rows=rows,
                        config=W2DgradConfig(block_m=block, block_n=128, block_k=64))
    assert calls == []


def test_w2_dgrad_lockstep_rule():
    """The W2 DGRAD heuristic's lockstep rule (whatever the device): 96 to 191 rows per
    expert with the rank's W2 weights at least 3 GiB (run 53: DeepSeek-V3 and V4-Flash
    gained, GPT-OSS-120B's 2.1 GB was even, 0.4 GB lost); never without the expert count."""
    rule = lambda rows, e, d, f: rules.w2_dgrad_config(  # noqa: E731
        rows_per_expert=rows, num_experts=e, hidden=d, ffn=f, device_class="h100").lockstep
    assert rule(128, 256, 7168, 2048) and rule(96, 256, 4096, 2048)  # 7.5 GB, 4 GiB
    assert rule(191, 256, 4096, 2048) and not rule(192, 256, 4096, 2048)
    assert not rule(95, 256, 4096, 2048) and not rule(256, 256, 7168, 2048)
    assert not rule(128, 128, 2880, 2880) and not rule(128, 128, 2048, 768)  # 2.1, 0.4 GB
    assert rule(128, 192, 4096, 2048) and not rule(128, 191, 4096, 2048)  # 3 GiB, under
    assert not rule(128, None, 7168, 2048)
    assert not rule(128, 32, 7168, 2048)  # DeepSeek-V3 at EP=8: 0.94 GB per rank


def test_w2_dgrad_expert_groups_rule():
    """The W2 DGRAD heuristic's Gluon pick walks its tiles in expert-group order at 16 to 768
    rows per expert on a Hopper device class (the kernel faster there, slower at 1024 and
    2048)."""
    pick = lambda rows: rules.w2_dgrad_config(  # noqa: E731
        hidden=7168, ffn=2048, rows_per_expert=rows, device_class="h100", num_experts=256)
    assert all(pick(rows).gluon for rows in (16, 64, 96, 128, 512, 1024))
    assert [pick(rows).expert_groups for rows in (8, 15, 16, 24, 64, 512, 768, 769, 1024)] \
        == [False, False, True, True, True, True, True, False, False]
    assert pick(128).lockstep and pick(128).expert_groups  # both at DeepSeek-V3 (run 60)


@pytest.mark.gpu
def test_gluon_w2_dgrad_heuristic():
    """On a Hopper GPU with the layer's hint the heuristic picks the Gluon kernel in its split
    form (8 epilogue warps, one fp32 tile buffer; 5 stages at >= 1024 rows per expert, 4
    below); widths it cannot tile keep the Triton config."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] != 9:
        pytest.skip("the Gluon W2 DGRAD is for compute capability 9.x")
    big = rules.w2_dgrad_config(hidden=4096, ffn=2048, rows_per_expert=2048, device_class=device_class(dev))
    small = rules.w2_dgrad_config(hidden=2048, ffn=768, rows_per_expert=256, device_class=device_class(dev))
    assert (big.gluon, big.block_n, big.num_stages) == (True, 128, 5)
    assert (small.gluon, small.block_n, small.num_stages) == (True, 128, 4)
    for cfg in (big, small):
        assert (cfg.epilogue_warps, cfg.epilogue_buffers) == (8, 1)
    odd = rules.w2_dgrad_config(hidden=4096, ffn=2000, rows_per_expert=2048, device_class=device_class(dev))
    assert not odd.gluon
    # F = 2880 (GPT-OSS): the split kernel, each row's last column tile partial
    tail = rules.w2_dgrad_config(hidden=2880, ffn=2880, rows_per_expert=128, device_class=device_class(dev))
    assert (tail.gluon, tail.block_n, tail.epilogue_warps) == (True, 128, 8)
    # lockstep with the local expert count where the rule takes it (DeepSeek-V3), else off
    assert not any(c.lockstep for c in (big, small, tail))
    assert rules.w2_dgrad_config(hidden=7168, ffn=2048, rows_per_expert=128, device_class=device_class(dev),
                                        num_experts=256).lockstep
    assert not rules.w2_dgrad_config(hidden=2880, ffn=2880, rows_per_expert=128,
                                            device_class=device_class(dev), num_experts=128).lockstep
    # the expert-group tile order at 16 to 768 rows per expert (runs 60-62)
    groups = [rules.w2_dgrad_config(hidden=2048, ffn=768, rows_per_expert=rows,
                                           device_class=device_class(dev)).expert_groups
              for rows in (8, 16, 96, 128, 512, 768, 769, 1024, 2048)]
    assert groups == [False, True, True, True, True, True, False, False, False]
    assert tail.expert_groups and not big.expert_groups
