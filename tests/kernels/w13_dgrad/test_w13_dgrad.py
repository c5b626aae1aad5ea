"""W13 DGRAD scatter (Triton and Gluon) against the plain-PyTorch reference.

Layouts, poisoning and tolerances: :mod:`backward_cases` (tests/kernels/backward_cases.py).
"""

import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from backward_cases import (
    DEVICE,
    assert_bf16_close,
    assert_walks_several_tiles,
    build_layout,
    layout_from_routes,
    make_ids,
    row_table,
    same_bits,
)

from distmoe.kernels.w2_dgrad.config import W2DgradConfig
from distmoe.kernels.w13_dgrad.config import W13DgradConfig
from distmoe.kernels.w13_dgrad.triton import w13_dgrad_scatter, w13_dgrad_scatter_ref
from distmoe.plan import device_class, rules


def _w13_problem(num_experts, hidden, ffn, block_m, experts):
    """Experts not in ``experts`` get no rows; experts 0 and 2 an extra tile of padding rows
    (expert 2 with no routes: a padding tile only). Spare grad_h1 rows past the live end are
    NaN (read by the last tile's padding rows, never stored)."""
    num_tokens, top_k = 11, 3
    ids = make_ids(num_tokens, top_k, experts)
    layout = build_layout(ids, num_experts, block_m, extra_tiles={0: 1, 2: 1})
    return (layout, *_w13_operands(layout, num_experts, hidden, ffn))


def _w13_operands(layout, num_experts, hidden, ffn):
    """Random ``w13`` and ``grad_h1`` for ``layout``; grad_h1's spare rows past the live end
    are NaN."""
    w13 = (torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(ffn)).bfloat16()
    grad_h1 = torch.randn(layout.num_act, 2 * ffn, device=DEVICE).bfloat16()
    grad_h1[~layout.live_act()] = float("nan")
    return w13, grad_h1


def _w13_targets(layout, hidden, *, t_max=12, top_k=3):
    """A dispatch buffer (route rows) and canary rows for the padding and idle entries (both
    random: rows that must stay untouched), and the pointer table into them."""
    dispatch = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    canary = torch.randn(3, hidden, device=DEVICE).bfloat16()
    return dispatch, canary, row_table(layout, dispatch, canary=canary)


def _check_w13_scatter(layout, dispatch, dispatch_before, canary, canary_before, ref, *,
                       stored=None):
    """Live routes (or the padded rows ``stored``, bool [R_cap]) hold the reference rounded
    once; every other dispatch row and the canaries keep their bits."""
    is_route = (layout.is_live if stored is None else stored).to(DEVICE)
    targets = layout.route_of_row.to(DEVICE)[is_route]
    # One fp32 GEMM rounded to bf16.
    assert_bf16_close(dispatch[targets], ref[is_route])
    untouched = torch.ones(dispatch.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[targets] = False  # inactive routes and rows beyond T*K: not written
    assert untouched.any()
    assert same_bits(dispatch[untouched], dispatch_before[untouched])
    assert same_bits(canary, canary_before)


@pytest.mark.parametrize(
    "one_expert,host_descriptors",
    [
        (False, True),
        (True, True),  # every route to one expert
        (False, False),  # TMA descriptors built in the kernel
    ],
)
def test_w13_dgrad_scatter(one_expert, host_descriptors):
    num_experts, hidden, ffn, block_m = 5, 40, 24, 16  # prime E; 2F = 48: a K tail with
    # block_k 32; D tail too. Experts 2 and 3 get no rows.
    layout, w13, grad_h1 = _w13_problem(
        num_experts, hidden, ffn, block_m, [1] if one_expert else [0, 1, 4]
    )
    dispatch, canary, ptrs = _w13_targets(layout, hidden)
    dispatch_before, canary_before = dispatch.clone(), canary.clone()

    config = W13DgradConfig(
        block_m=block_m, block_n=32, block_k=32, num_warps=4, host_descriptors=host_descriptors
    )
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs, config=config)

    ref = w13_dgrad_scatter_ref(
        grad_h1, layout.padded_offsets, layout.row_offsets, w13, num_rows=layout.num_rows
    )
    _check_w13_scatter(layout, dispatch, dispatch_before, canary, canary_before, ref)


@pytest.mark.parametrize("dynamic", [False, True], ids=["strided", "dynamic"])
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
def test_w13_dgrad_persistent(host_descriptors, dynamic):
    """persistent=True is bit-identical to one program per tile (same tiles, computed the same
    way): every destination row, the untouched ones and the canaries included; with
    ``dynamic`` the programs take their tiles from a counter."""
    num_experts, hidden, ffn, block_m, block_n = 5, 40, 24, 16, 32
    layout, w13, grad_h1 = _w13_problem(num_experts, hidden, ffn, block_m, [0, 1, 4])
    live_tiles = int(layout.padded_offsets[-1]) // block_m * math.ceil(hidden / block_n)
    results = {}
    for persistent in (False, True):
        torch.manual_seed(1)  # the same destination contents for both grids
        dispatch, canary, ptrs = _w13_targets(layout, hidden)
        dispatch_before, canary_before = dispatch.clone(), canary.clone()
        config = W13DgradConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=4,
                                persistent=persistent, host_descriptors=host_descriptors,
                                dynamic=dynamic and persistent)
        if persistent:
            assert_walks_several_tiles(
                config, layout.num_rows // block_m * math.ceil(hidden / block_n), live_tiles
            )
        w13_dgrad_scatter(
            grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs, config=config
        )
        results[persistent] = (dispatch, dispatch_before, canary, canary_before)
    assert same_bits(results[True][0], results[False][0])
    assert same_bits(results[True][1], results[False][1])  # same contents before the runs
    ref = w13_dgrad_scatter_ref(
        grad_h1, layout.padded_offsets, layout.row_offsets, w13, num_rows=layout.num_rows
    )
    _check_w13_scatter(layout, *results[True], ref)


def _w13_dgrad_pair_tails_case(counts, hidden, ffn, config, *, null_rows=(), launch=None):
    """W13 DGRAD with ``counts`` live rows per expert (experts 0 and 2 get an extra padding
    tile) against the reference: every live route holds it; nothing else (other dispatch
    rows, the canaries behind padding and idle entries) is written. ``null_rows``: padded
    rows whose (live) entry is 0, their routes not written. ``launch(grad_h1, po, ro, w13,
    ptrs)`` runs the kernel (default: ``w13_dgrad_scatter`` with ``config``). Returns the
    routes' rows, for comparing configs."""
    torch.manual_seed(11)
    routes, start = [], 0
    for c in counts:
        routes.append(torch.randperm(c) + start)
        start += c
    layout = layout_from_routes(routes, config.block_m, extra_tiles={0: 1, 2: 1})
    w13, grad_h1 = _w13_operands(layout, len(counts), hidden, ffn)
    dispatch, canary, ptrs = _w13_targets(layout, hidden, t_max=start + 4, top_k=1)
    null = torch.zeros(layout.num_rows, dtype=torch.bool)
    null[list(null_rows)] = True
    assert layout.is_live[null].all(), "null_rows must be live rows"
    ptrs[null.to(DEVICE)] = 0
    dispatch_before, canary_before = dispatch.clone(), canary.clone()
    if launch is None:
        w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                          config=config)
    else:
        launch(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs)
    ref = w13_dgrad_scatter_ref(
        grad_h1, layout.padded_offsets, layout.row_offsets, w13, num_rows=layout.num_rows
    )
    _check_w13_scatter(layout, dispatch, dispatch_before, canary, canary_before, ref,
                       stored=layout.is_live & ~null)
    return dispatch


# block_m 32: tails of 1 and of 16 (exactly half) after a whole tile (pairs), an empty
# expert, whole tiles only, a last tile of 17 (no pair), a one-tile expert of 1 row (no
# pair), a tail of 5 after two whole tiles (the last two a pair), whole tiles, a one-tile
# expert of 17 rows
PAIR_COUNTS = [33, 48, 0, 64, 49, 1, 69, 96, 17]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "tile_grid"])
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
def test_w13_dgrad_pair_tails(host_descriptors, persistent):
    """pair_tails: an expert's last tile with at most block_m / 2 live rows is computed
    with the tile before it (two halves of block_n / 2 columns over both)."""
    config = W13DgradConfig(block_m=32, block_n=32, block_k=32, num_warps=4,
                            persistent=persistent, host_descriptors=host_descriptors,
                            pair_tails=True)
    # D = 40: a column tail (the halves are 16 wide: the second half of the last column tile
    # is past D); 2F = 48: a K tail
    _w13_dgrad_pair_tails_case(PAIR_COUNTS, 40, 24, config)


def test_w13_dgrad_dynamic_rules():
    with pytest.raises(ValueError, match="dynamic=True needs persistent=True"):
        W13DgradConfig(dynamic=True)
    with pytest.raises(TypeError, match="dynamic must be a bool"):
        W13DgradConfig(persistent=True, dynamic=1)
    # moving a config to the tile grid drops the hand-out; back keeps it off
    handed = W13DgradConfig(persistent=True, dynamic=True, pair_tails=True)
    assert handed.with_grid(False) == W13DgradConfig(pair_tails=True)
    assert handed.with_grid(True) == handed
    assert handed.with_grid(False).with_grid(True) == replace(handed, dynamic=False)
    assert W2DgradConfig().with_grid(True) == W2DgradConfig(persistent=True)


def test_w13_dgrad_pair_tails_rules():
    with pytest.raises(ValueError, match="pair_tails=True needs block_n >= 32, got block_n=16"):
        W13DgradConfig(block_n=16, pair_tails=True)
    with pytest.raises(TypeError, match="pair_tails must be a bool"):
        W13DgradConfig(pair_tails=1)


@pytest.mark.gpu
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
def test_w13_dgrad_pair_tails_gpu(host_descriptors):
    """The layer's tiles (128 x 256, persistent) with pair_tails and / or dynamic: last tiles
    of 1, 64 (a pair), 65, 100 and 127 rows, one after two whole tiles, whole tiles, an empty
    expert, a one-tile expert; D = 768. The routes' rows equal the plain kernel's bit for bit
    (the same MMAs per row in the same order)."""
    base = rules.w13_dgrad_config(hidden=768, ffn=384, rows_per_expert=256)
    assert base.persistent and base.block_m == 128 and base.pair_tails and base.dynamic
    counts = [129, 192, 0, 256, 193, 228, 64, 255, 1, 300]
    got = {}
    for pair, dynamic in ((False, False), (True, False), (True, True), (False, True)):
        config = replace(base, host_descriptors=host_descriptors, pair_tails=pair,
                         dynamic=dynamic)
        got[pair, dynamic] = _w13_dgrad_pair_tails_case(counts, 768, 384, config)
    for key, value in got.items():
        assert same_bits(value, got[False, False]), key


# the Gluon W13 DGRAD (w2_gluon.launch_gluon_w13_dgrad): last tiles of 1, 64, 65, 100 and
# 127 rows, whole tiles, an empty expert, one-row and 300-row experts; D = 768 (three
# cooperative 256-column tiles), 2F = 768
GLUON_W13D_COUNTS = [129, 192, 0, 256, 193, 228, 64, 255, 1, 300]


# live rows stored nowhere (entry 0): rows 3 and 100 (the first tile's two 64-row halves),
# 1216 (expert 4's last live row, in its last tile), 1299 (inside expert 5's first tile), 1664
# (expert 7's first row), 1920 (the one-row expert 8's only row: a tile whose live rows are
# all skipped); padded offsets 0, 384, 640, 768, 1024, 1280, 1536, 1664, 1920, 2048
GLUON_W13D_NULL = [3, 100, 1216, 1299, 1664, 1920]


def _gluon_w13d_config(warps, stages, hidden=768):
    from distmoe.kernels.w13_dgrad.gluon import gluon_w13_dgrad_reason

    block_n = 256 if warps == 8 else 128
    config = W13DgradConfig(block_m=128, block_n=block_n, block_k=64, num_warps=warps,
                            num_stages=stages, persistent=True, gluon=True)
    reason = gluon_w13_dgrad_reason(DEVICE, hidden=hidden, ffn=384, block_m=128,
                                    block_n=block_n, block_k=64, stages=stages, warps=warps)
    assert reason is None, f"the Gluon W13 DGRAD would not run here: {reason}"
    return config


@pytest.mark.gpu
@pytest.mark.parametrize("warps, stages, group_m", [(4, 5, 8), (4, 6, 16), (4, 3, 8),
                                                    (8, 4, 8), (8, 3, 16)])
def test_gluon_w13_dgrad(warps, stages, group_m):
    """The Gluon W13 DGRAD through ``w13_dgrad_scatter`` (one program per SM), ping-pong and
    cooperative tiles, against the reference (one fp32 GEMM rounded once; nothing but the
    live, non-null routes written; NaN grad_h1 rows past the live end never reach them)
    and bit for bit against the Triton kernel on the same tiles where both run the same
    MMA instructions in the same K order (cooperative 128 x 256: m64n256k16 per warpgroup)."""
    config = replace(_gluon_w13d_config(warps, stages), group_m=group_m)
    got = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config,
                                     null_rows=GLUON_W13D_NULL)
    triton_cfg = W13DgradConfig(block_m=128, block_n=config.block_n, block_k=64,
                                num_warps=8 if warps == 8 else 4, num_stages=3,
                                persistent=True)
    want = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, triton_cfg,
                                      null_rows=GLUON_W13D_NULL)
    if warps == 8:
        assert same_bits(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
def test_gluon_w13_dgrad_partial_column_tile(warps):
    """D = 832, not a multiple of the tile's 128 or 256 columns (as GPT-OSS's 2880): each
    row's last tile is partial, its weight columns past D TMA zeros, its parts past D not
    stored (the NaN-poisoned output shows a store past a row's end); against the reference
    and, cooperative, bit for bit against the Triton kernel's 128 x 256 tiles."""
    config = _gluon_w13d_config(warps, 4, hidden=832)
    got = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 832, 384, config,
                                     null_rows=GLUON_W13D_NULL)
    if warps == 8:
        triton_cfg = W13DgradConfig(block_m=128, block_n=256, block_k=64, num_warps=8,
                                    num_stages=3, persistent=True)
        want = _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 832, 384, triton_cfg,
                                          null_rows=GLUON_W13D_NULL)
        assert same_bits(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_gluon_w13_dgrad_programs_walk_many_tiles(warps, programs):
    """Few programs: each walks many tiles across expert boundaries, its ring's phases wrap
    many times and the ping-pong consumers take turns many times (odd counts included)."""
    from distmoe.kernels.w13_dgrad.gluon import launch_gluon_w13_dgrad

    config = _gluon_w13d_config(warps, 4)
    launch = partial(launch_gluon_w13_dgrad, block_n=config.block_n, stages=4, warps=warps,
                     programs=programs)
    _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config, null_rows=GLUON_W13D_NULL,
                               launch=launch)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
@pytest.mark.parametrize("programs", [3, None, "twice_the_sms"])
def test_gluon_w13_dgrad_lockstep(warps, programs):
    """``W13DgradConfig.lockstep``: the producers wait on a device counter for the wave
    before each tile. Through ``w13_dgrad_scatter`` with one program per SM; few programs
    walking many tiles (the last wave's idle programs must not hold the others' waits); and
    twice as many programs as SMs over eight times the rows (the programs not resident at
    first make the others' waits miss their bound, after which each stops waiting). Same
    rows as the reference, nothing else written."""
    from distmoe.kernels.base.device import num_sms
    from distmoe.kernels.w13_dgrad.gluon import launch_gluon_w13_dgrad

    config = replace(_gluon_w13d_config(warps, 4), lockstep=True)
    if programs is None:
        _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config,
                                   null_rows=GLUON_W13D_NULL)
        return
    counts, null = GLUON_W13D_COUNTS, GLUON_W13D_NULL
    if programs == "twice_the_sms":
        programs = 2 * num_sms(DEVICE)
        counts, null = [8 * n for n in counts], ()
    launch = partial(launch_gluon_w13_dgrad, block_n=config.block_n, stages=4, warps=warps,
                     programs=programs, lockstep=True)
    _w13_dgrad_pair_tails_case(counts, 768, 384, config, null_rows=null, launch=launch)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8], ids=["pingpong", "coop"])
@pytest.mark.parametrize("lockstep", [False, True], ids=["free", "lockstep"])
@pytest.mark.parametrize("programs", [1, 3, None])
def test_gluon_w13_dgrad_expert_groups(warps, lockstep, programs):
    """``W13DgradConfig.expert_groups``: each expert's tiles walked column tile by column
    tile over its row blocks (one to three here, with a padding-only tile, an empty expert,
    a one-row expert). A tile missed or taken twice leaves a route unwritten or wrong, or
    writes a canary: through ``w13_dgrad_scatter`` (one program per SM) and with few
    programs walking many tiles."""
    from distmoe.kernels.w13_dgrad.gluon import launch_gluon_w13_dgrad

    config = replace(_gluon_w13d_config(warps, 4), lockstep=lockstep, expert_groups=True)
    launch = None if programs is None else partial(
        launch_gluon_w13_dgrad, block_n=config.block_n, stages=4, warps=warps,
        programs=programs, lockstep=lockstep, expert_groups=True)
    _w13_dgrad_pair_tails_case(GLUON_W13D_COUNTS, 768, 384, config, null_rows=GLUON_W13D_NULL,
                               launch=launch)


def test_gluon_w13_dgrad_request_that_cannot_run_warns_and_runs_triton():
    """``gluon=True`` where the Gluon kernel cannot run (here: the interpreter, or 32-row
    tiles it is not written for) says why in a RuntimeWarning; the Triton kernel then runs
    the config (pair_tails included) and is checked against the reference."""
    config = W13DgradConfig(block_m=32, block_n=32, block_k=32, num_warps=4, persistent=True,
                            pair_tails=True, gluon=True)
    with pytest.warns(RuntimeWarning, match=r"w13_dgrad_scatter: config\.gluon is set, but the "
                                            r"Gluon kernel cannot run this call \(.+\); the "
                                            r"Triton kernel runs the config instead"):
        _w13_dgrad_pair_tails_case(PAIR_COUNTS, 40, 24, config, null_rows=[2])


def test_gluon_w13_dgrad_rules():
    """The config field's type, and the shape rules of the Gluon W13 DGRAD (whatever the
    device): its two tiles, ring depths that fit, D and 2F multiples of 64 (a row's last
    column tile may be partial)."""
    from distmoe.kernels.w2_forward.gluon import shape_reason

    with pytest.raises(TypeError, match="gluon must be a bool, got int"):
        W13DgradConfig(gluon=1)
    with pytest.raises(TypeError, match="lockstep must be a bool, got str"):
        W13DgradConfig(gluon=True, lockstep="yes")
    with pytest.raises(TypeError, match="expert_groups must be a bool, got int"):
        W13DgradConfig(gluon=True, expert_groups=1)
    rule = partial(shape_reason, block_m=128, block_k=64, w13_dgrad=True)
    assert rule(hidden=768, ffn=384, block_n=256, stages=4, warps=8) is None
    assert rule(hidden=768, ffn=384, block_n=128, stages=6, warps=4) is None
    assert rule(hidden=768, ffn=32, block_n=128, stages=6, warps=4) is None  # 2F = 64
    assert rule(hidden=768, ffn=48, block_n=128, stages=6, warps=4) == (
        "D (768) must be a multiple of 64 and 2F (96) of 64")
    assert rule(hidden=640, ffn=384, block_n=256, stages=4, warps=8) is None  # 2.5 tiles
    assert rule(hidden=672, ffn=384, block_n=256, stages=4, warps=8) == (
        "D (672) must be a multiple of 64 and 2F (768) of 64")
    assert "the Gluon W13 DGRAD kernel runs (block_m, block_n, block_k, num_warps) in" in rule(
        hidden=768, ffn=384, block_n=256, stages=4, warps=4)
    assert rule(hidden=768, ffn=384, block_n=256, stages=5, warps=8) == (
        "stages must be one of [3, 4] with block_n = 256 and num_warps = 8, got 5")
    # the W2 forward's rules name F, not 2F
    assert shape_reason(hidden=768, ffn=96, block_m=128, block_n=128, block_k=64, stages=6,
                        warps=4) == "D (768) must be a multiple of 64 and F (96) of 64"


def test_gluon_w13_dgrad_heuristic_rules():
    """Where the heuristic takes the Gluon W13 DGRAD (whatever the device): ping-pong 128 x
    128 tiles, 6 stages from 256 rows per expert and 5 below, from 128 rows per expert while
    the rank's W13 weights total under 2 GiB and the kernel tiles the shape; elsewhere the
    Triton pick. Off a Hopper GPU (here: the CPU) the pick stays the Triton one."""
    pick = rules.w13_dgrad_gluon
    tile = lambda c: (c.gluon, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    # T=4096 D=2048 F=768 E=128 (256 rows per expert), T=2048 (128), OLMoE, T=8192 D=4096
    # F=2048 E=32: the measured wins of run 44
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=256, num_experts=128)) == (
        True, 128, 4, 6)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=128, num_experts=128)) == (
        True, 128, 4, 5)
    assert tile(pick(hidden=2048, ffn=1024, rows_per_expert=512, num_experts=64)) == (
        True, 128, 4, 6)
    assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=2048, num_experts=32)) == (
        True, 128, 4, 6)
    # DeepSeek-V3 (15 GB of W13 weights) and V4-Flash (8 GB): slower with Gluon (run 44);
    # DeepSeek-V3's experts (56 MiB each) stay on Triton with 32 per rank too (1.75 GiB in
    # all); V4-Flash's (32 MiB, the bound) take Gluon there
    assert pick(hidden=7168, ffn=2048, rows_per_expert=128, num_experts=256) is None
    assert pick(hidden=4096, ffn=2048, rows_per_expert=192, num_experts=256) is None
    assert pick(hidden=7168, ffn=2048, rows_per_expert=128, num_experts=32) is None
    assert pick(hidden=4096, ffn=2048, rows_per_expert=192, num_experts=32).gluon
    assert pick(hidden=4096, ffn=2080, rows_per_expert=192, num_experts=8) is None  # > 32 MiB
    # the bound: 64 experts of 2F*D = 2^24 values are exactly 2 GiB; one fewer is under it
    assert pick(hidden=4096, ffn=2048, rows_per_expert=256, num_experts=64) is None
    assert pick(hidden=4096, ffn=2048, rows_per_expert=256, num_experts=63).gluon
    # fewer rows, no expert count, a width the kernel cannot tile
    assert pick(hidden=2048, ffn=768, rows_per_expert=127, num_experts=128) is None
    assert pick(hidden=2048, ffn=768, rows_per_expert=256, num_experts=None) is None
    assert pick(hidden=2912, ffn=2880, rows_per_expert=256, num_experts=8) is None
    # D = 2880 (GPT-OSS): a partial last column tile; 8 experts are 0.25 GiB, 128 are 4 GiB
    assert tile(pick(hidden=2880, ffn=2880, rows_per_expert=256, num_experts=8)) == (
        True, 128, 4, 6)
    assert pick(hidden=2880, ffn=2880, rows_per_expert=128, num_experts=128) is None
    # the expert-group tile order at 128 to 512 rows per expert (run 59: 1.043x at the first
    # shape above, 1.009x at OLMoE, 0.951x at 2048 rows per expert; run 60: the kernel
    # 1.05-1.25x at 128-512, 0.986x at 1024)
    groups = lambda rows, **kw: pick(hidden=2048, ffn=768, rows_per_expert=rows,  # noqa: E731
                                     num_experts=128, **kw).expert_groups
    assert groups(128) and groups(255) and groups(256) and groups(512)
    assert not any(groups(rows) for rows in (513, 1024, 2048))
    assert pick(hidden=2048, ffn=1024, rows_per_expert=512, num_experts=64).expert_groups
    assert not pick(hidden=4096, ffn=2048, rows_per_expert=2048, num_experts=32).expert_groups
    triton_pick = rules.w13_dgrad_config(hidden=2048, ffn=768, rows_per_expert=256)
    assert not triton_pick.gluon and triton_pick.dynamic and triton_pick.pair_tails
    assert rules.w13_dgrad_config(hidden=2048, ffn=768, rows_per_expert=256,
                                         device_class=device_class(torch.device("cpu")),
                                         num_experts=128) == triton_pick


@pytest.mark.gpu
def test_gluon_w13_dgrad_heuristic_gpu():
    """On a Hopper GPU the layer's pick (hint and local expert count given) is the Gluon
    kernel where :func:`distmoe.plan.rules.w13_dgrad_gluon` takes it, else the Triton pick."""
    if torch.cuda.get_device_capability(DEVICE)[0] != 9:
        pytest.skip("the Gluon W13 DGRAD is for compute capability 9.x")
    pick = partial(rules.w13_dgrad_config, device_class=device_class(DEVICE))
    fine = pick(hidden=2048, ffn=768, rows_per_expert=256, num_experts=128)
    assert (fine.gluon, fine.block_n, fine.num_warps, fine.num_stages) == (True, 128, 4, 6)
    dsv3 = pick(hidden=7168, ffn=2048, rows_per_expert=128, num_experts=256)
    assert not dsv3.gluon and dsv3.pair_tails
    assert not pick(hidden=2048, ffn=768, rows_per_expert=256).gluon  # no expert count


def test_gluon_w13_dgrad_config_reaches_the_launch(monkeypatch):
    """The config's tile reaches the Gluon launch (``num_warps``, ``block_n``, ``num_stages``,
    ``group_m``), on any machine: the launcher is a recorder and the check admits the case.
    ``gluon=False`` never calls either."""
    import distmoe.kernels.w13_dgrad.gluon as wg

    calls = []
    monkeypatch.setattr(wg, "gluon_w13_dgrad_reason",
                        lambda device, **kw: calls.append(("reason", kw)) and None)
    monkeypatch.setattr(wg, "launch_gluon_w13_dgrad",
                        lambda *a, **kw: calls.append(("launch", kw)))
    layout, w13, grad_h1 = _w13_problem(5, 256, 32, 128, [0, 1, 4])
    dispatch, canary, ptrs = _w13_targets(layout, 256)
    before = dispatch.clone()
    for warps, block_n, stages, group_m in ((4, 128, 6, 8), (8, 256, 3, 16)):
        calls.clear()
        config = W13DgradConfig(block_m=128, block_n=block_n, block_k=64, num_warps=warps,
                                num_stages=stages, group_m=group_m, gluon=True)
        w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                          config=config)
        (_, reason), (_, launch) = calls
        assert (reason["block_n"], reason["warps"], reason["stages"]) == (block_n, warps, stages)
        assert (launch["block_n"], launch["warps"], launch["stages"], launch["group_m"]) == (
            block_n, warps, stages, group_m)
        assert launch["lockstep"] is False and launch["expert_groups"] is False
    calls.clear()
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                      config=replace(config, lockstep=True))
    assert calls[1][1]["lockstep"] is True and calls[1][1]["expert_groups"] is False
    calls.clear()
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                      config=replace(config, expert_groups=True))
    assert calls[1][1]["expert_groups"] is True and calls[1][1]["lockstep"] is False
    assert same_bits(dispatch, before)  # the recorder launched nothing
    calls.clear()
    w13_dgrad_scatter(grad_h1, layout.padded_offsets, layout.row_offsets, w13, ptrs,
                      config=W13DgradConfig(block_m=128, block_n=128, block_k=32, num_warps=4))
    assert calls == []
    assert not same_bits(dispatch, before)  # the Triton kernel ran
