"""W2 scatter forward (Triton and Gluon) against the plain-PyTorch reference.

Layouts, poisoning and tolerances: :mod:`kernel_cases` (tests/kernels/kernel_cases.py).
"""

import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from kernel_cases import (
    BM,
    DEVICE,
    GLUON_COUNTS,
    GLUON_R_CAP,
    GRIDS,
    META_I32,
    PERSISTENT,
    W2_SMALL,
    W13_SMALL,
    addr,
    assert_bf16_close,
    assert_bits_equal,
    assert_untouched,
    bf16_bound,
    build_layout,
    device_int,
    poisoned,
    random_weights,
)

from distmoe.kernels.w2_forward.config import W2Config
from distmoe.kernels.w2_forward.triton import w2_scatter, w2_scatter_ref
from distmoe.plan import device_class, rules


def _assert_rows_bf16_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """:func:`assert_bf16_close` on every row of ``got`` / ``want`` (fp64, CPU), each row
    with its own scale, found at once; the first bad row fails there, named by
    ``what(row)``."""
    scale = want.abs().amax(dim=1, keepdim=True)
    bad = torch.isnan(got).any(dim=1) | ((got - want).abs() > bf16_bound(want, scale)).any(1)
    if bad.any():
        k = int(bad.nonzero()[0])
        assert_bf16_close(got[k], want[k], what=what(k))


class W2Case:
    """Inputs of one W2 call: h2 in activation rows (NaN beyond ``row_offsets[-1]``), every
    live row with its own destination in one of three peer buffers (except ``skip_live``
    rows, address 0), and padding / idle rows addressing a canary that must stay poisoned."""

    def __init__(self, counts, *, hidden, ffn, r_cap, block_m=BM, min_rows=None, act_slack=3,
                 skip_live=()):  # fmt: skip
        self.hidden, self.r_cap = hidden, r_cap
        self.layout = layout = build_layout(counts, r_cap=r_cap, block_m=block_m, min_rows=min_rows)
        n = layout.num_act
        self.targets = [poisoned(n, hidden), poisoned(9, 2, hidden), poisoned(n + 3, hidden)]
        slots = [(i, j) for i, t in enumerate(self.targets) for j in range(t.numel() // hidden)]
        order = torch.randperm(len(slots)).tolist()
        ptrs = torch.zeros(r_cap, dtype=torch.int64)
        self.destination = {}  # activation row -> (target, row)
        for a, r in enumerate(r for rows in layout.live for r in rows):
            if a in skip_live:
                continue
            i, j = slots[order[a]]
            ptrs[r] = addr(self.targets[i], j, hidden)
            self.destination[a] = (i, j)
        # Padding rows and rows beyond padded_offsets[-1] carry addresses too: never stored.
        unused = layout.padding + list(range(layout.padded[-1], r_cap))
        self.canary = poisoned(max(1, len(unused)), hidden)
        for c, r in enumerate(unused):
            ptrs[r] = addr(self.canary, c, hidden)
        self.scatter_ptrs = ptrs.to(DEVICE)
        # Rows beyond row_offsets[-1] are NaN: tiles read them past a segment's live rows
        # (or TMA zero-fills past R_act) and must discard the results.
        self.h2 = torch.randn(n + act_slack, ffn, device=DEVICE).to(torch.bfloat16)
        self.h2[n:] = float("nan")
        _, self.w2 = random_weights(len(counts), hidden, ffn)

    def run(self, *, config, use_ref=False, **kwargs):
        args = (self.h2, self.layout.padded_offsets, self.layout.row_offsets, self.w2)
        if use_ref:
            w2_scatter_ref(
                *args, self.scatter_ptrs, targets=self.targets, block_m=config.block_m, **kwargs
            )
        else:
            w2_scatter(*args, self.scatter_ptrs, config=config, **kwargs)

    def outputs(self):
        return [*self.targets, self.canary]

    def repoison(self):
        for out in self.outputs():
            out.fill_(float("nan"))

    def check(self):
        """Every stored row against the fp64 reference, each row under
        :func:`assert_bf16_close`'s bound with its own scale (a wrong row names its
        activation row and expert); rows no stored row points at, and the canary, untouched.
        The reference is one matmul per expert and the rows are fetched once per target
        (per-row copies of the expert's weights made a GPU test take a minute)."""
        hidden = self.hidden
        experts = self.layout.expert_of_act()
        acts = list(self.destination)
        written = [torch.zeros(t.numel() // hidden, dtype=torch.bool) for t in self.targets]
        got = torch.empty(len(acts), hidden, dtype=torch.float64)
        want = torch.empty_like(got)
        h2, w2 = self.h2.double().cpu(), self.w2.double().cpu()
        for i, t in enumerate(self.targets):
            ks = [k for k, a in enumerate(acts) if self.destination[a][0] == i]
            js = torch.tensor([self.destination[acts[k]][1] for k in ks], dtype=torch.long)
            got[ks] = t.reshape(-1, hidden)[js.to(t.device)].double().cpu()
            written[i][js] = True
        for e in sorted({experts[a] for a in acts}):
            ks = [k for k, a in enumerate(acts) if experts[a] == e]
            want[ks] = h2[[acts[k] for k in ks]] @ w2[e].T
        _assert_rows_bf16_close(got, want, lambda k: (f"h3 of activation row {acts[k]} "
                                                      f"(expert {experts[acts[k]]})"))
        for i, t in enumerate(self.targets):
            rows = t.reshape(-1, hidden)
            # Rows no stored row points at (skipped or spare) keep the poison bit-exactly.
            assert_untouched(rows[(~written[i]).to(DEVICE)], what=f"target {i} rows not addressed")
        assert_untouched(self.canary, what="rows addressed by padding rows and idle tiles")


def run_w2_case(counts, *, hidden, ffn, r_cap, config, min_rows=None, use_ref=False,
                act_slack=3, skip_live=()):  # fmt: skip
    case = W2Case(
        counts, hidden=hidden, ffn=ffn, r_cap=r_cap, block_m=config.block_m, min_rows=min_rows,
        act_slack=act_slack, skip_live=skip_live,
    )  # fmt: skip
    case.run(config=config, use_ref=use_ref)
    case.check()
    return case


@GRIDS
def test_w2_scatter_mixed_experts(persistent, host_descriptors):
    # Experts with 5, 0, 16 and 21 live rows, the empty one padded to a whole tile of padding,
    # D=48 not a multiple of block_n=32, F=40 not a multiple of block_k=32, destinations in
    # three peer buffers, one live row skipped (address 0), padding rows and idle tiles with
    # live-looking addresses, NaN activation rows beyond row_offsets[-1].
    config = replace(W2_SMALL, persistent=persistent, host_descriptors=host_descriptors)
    run_w2_case(
        [5, 0, 16, 21], hidden=48, ffn=40, r_cap=112, config=config, min_rows=[0, 16, 0, 0],
        skip_live=[9],
    )  # fmt: skip


@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
def test_w2_scatter_one_expert_all_rows(host_descriptors):
    # All rows go to the middle of three experts; R_cap exactly full; h2 holds exactly
    # row_offsets[-1] = 40 rows, so the last tile's TMA load runs past R_act (zero fill).
    config = replace(W2_SMALL, host_descriptors=host_descriptors)
    run_w2_case([0, 40, 0], hidden=32, ffn=64, r_cap=48, config=config, act_slack=0)


def test_w2_scatter_all_live_rows_skipped_in_a_tile():
    # Expert 0's only tile has all its live rows skipped (no GEMM work); expert 1 is stored.
    run_w2_case([3, 10], hidden=32, ffn=32, r_cap=48, config=W2_SMALL, skip_live=[0, 1, 2])


def test_w2_scatter_default_config_from_block_m():
    case = W2Case([9, 3], hidden=32, ffn=32, r_cap=48)
    layout = case.layout
    w2_scatter(
        case.h2, layout.padded_offsets, layout.row_offsets, case.w2, case.scatter_ptrs, block_m=BM
    )
    case.check()


def test_w2_scatter_reference():
    # The plain-PyTorch reference obeys the same contract (within the same tolerance).
    run_w2_case([5, 0, 21], hidden=32, ffn=48, r_cap=64, config=W2_SMALL, use_ref=True,
                skip_live=[4])  # fmt: skip


def check_w2_enable(case, config, *, references=(False, True)):
    """enable = 1 equals the plain run bit for bit; enable = 0 writes nothing (no target row,
    no canary), for the kernel and (``references``) the reference."""
    case.run(config=config)
    case.check()
    plain = [out.clone() for out in case.outputs()]
    case.repoison()
    case.run(config=config, enable=device_int([1], torch.int32))
    for i, (got, want) in enumerate(zip(case.outputs(), plain, strict=True)):
        assert_bits_equal(got, want, what=f"output buffer {i} with enable=1")
    for use_ref in references:
        case.repoison()
        case.run(config=config, use_ref=use_ref, enable=device_int([0], torch.int32))
        for i, out in enumerate(case.outputs()):
            assert_untouched(out, what=f"output buffer {i} with enable=0 (ref={use_ref})")


@PERSISTENT
def test_w2_scatter_enable(persistent):
    config = replace(W2_SMALL, persistent=persistent)
    check_w2_enable(W2Case([5, 0, 21], hidden=32, ffn=48, r_cap=64, min_rows=[0, 16, 0]),
                    config)


def _w2_inputs(r_cap=32, hidden=32, ffn=32, num_experts=2):
    _, w2 = random_weights(num_experts, hidden, ffn)
    return dict(
        h2=torch.zeros(7, ffn, dtype=torch.bfloat16, device=DEVICE),
        padded_offsets=torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE),
        row_offsets=torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE),
        w2=w2,
        scatter_ptrs=torch.zeros(r_cap, dtype=torch.int64, device=DEVICE),
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(h2=a["h2"].half()), TypeError, "h2 must have dtype bfloat16"),
        (lambda a: a.update(h2=a["h2"][:, :16].contiguous()), ValueError, r"h2 must have shape \[R_act, F=32\]"),
        (lambda a: a.update(h2=a["h2"].t()), ValueError, "h2 must be contiguous"),
        (lambda a: a.update(h2=a["h2"][:0]), ValueError, r"h2 must have R_act >= 1 rows .* when R_cap \(32\) > 0"),
        (lambda a: a.update(w2=a["w2"][:, :20].contiguous()), ValueError, r"D \(hidden\) \(20\) must be a positive multiple of 8"),
        (lambda a: a.update(scatter_ptrs=a["scatter_ptrs"][None]), ValueError, r"scatter_ptrs must be 1-D \[R_cap\]"),
        (lambda a: a.update(scatter_ptrs=a["scatter_ptrs"].float()), TypeError, "scatter_ptrs must have dtype int64"),
        (lambda a: a.update(scatter_ptrs=a["scatter_ptrs"][:24]), ValueError, r"R_cap \(24, rows of scatter_ptrs\) must be a multiple of block_m \(16\)"),
        (lambda a: a.update(padded_offsets=a["padded_offsets"][None]), ValueError, r"padded_offsets must have shape \[3\]"),
        (lambda a: a.update(row_offsets=a["row_offsets"].long()), TypeError, "row_offsets must have dtype int32, got torch.int64"),
        (lambda a: a.update(row_offsets=a["row_offsets"][:1]), ValueError, r"row_offsets must have shape \[3\] \[E_local \+ 1\] \(live rows per expert, exclusive prefix sum\), got \[1\]"),
        (lambda a: a.update(row_offsets=META_I32), ValueError, r"row_offsets must be on the same device as h2 \((cpu|cuda:\d+)\), got meta"),
        (lambda a: a.update(enable=torch.ones(1, dtype=torch.bool, device=DEVICE)), TypeError, "enable must have dtype int32, got torch.bool"),
        (lambda a: a.update(enable=torch.ones(2, dtype=torch.int32, device=DEVICE)), ValueError, r"enable must have shape \[1\] \(0 = skip\), got \[2\]"),
        (lambda a: a.update(enable=torch.ones(1, dtype=torch.int32, device="meta")), ValueError, "enable must be on the same device as h2"),
        (lambda a: a.update(config=W13_SMALL), TypeError, "config must be a W2Config"),
    ],
)  # fmt: skip
def test_w2_scatter_rejects_bad_inputs(change, error, match):
    args = _w2_inputs()
    args["config"] = W2_SMALL
    change(args)
    with pytest.raises(error, match=match):
        w2_scatter(**args)


@pytest.mark.gpu
@GRIDS
def test_gpu_w2_scatter_hopper_tiles(persistent, host_descriptors):
    # Default tiles, an empty expert padded to a whole null tile, two idle tiles.
    config = rules.w2_forward_config(hidden=1024, ffn=768)
    config = replace(config, persistent=persistent, host_descriptors=host_descriptors)
    counts = [300, 0, 129, 700, 1, 64]
    r_cap = sum(math.ceil(n / 128) * 128 for n in counts) + 2 * 128
    run_w2_case(counts, hidden=1024, ffn=768, r_cap=r_cap, config=config, min_rows=[0, 128, 0, 0, 0, 0])  # fmt: skip


# the warp-specialised Gluon W2 forward (w2_gluon): ping-pong 128 x 128 tiles
GLUON_W2 = W2Config(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=5,
                    group_m=8, persistent=True, gluon=True)


# the two tiles: ping-pong 128 x 128 (num_warps 4), cooperative 128 x 256 (num_warps 8)
GLUON_W2_TILE_PARAMS = pytest.mark.parametrize("block_n, warps", [(128, 4), (256, 8)],
                                               ids=["128x128", "128x256coop"])


# GLUON_COUNTS with expert 0 padded to 512 rows (its last tile is padding only: the tile walk
# sees a negative live count) and the empty expert to a whole padding tile
GLUON_W2_MIN_ROWS = [512, 128, 0, 0, 0, 0, 0, 0]


# live rows stored nowhere (address 0): row 5; row 72 of expert 3's first tile (the second
# cooperative consumer's half); row 700; the one-row expert's only row (a tile whose live
# rows are all skipped)
GLUON_W2_SKIP = [5, 500, 700, 1428]


def _gluon_w2_tile(block_n, warps, stages=None, hidden=1024):
    """GLUON_W2 with a tile of GLUON_W2_TILE_PARAMS (the cooperative one takes at most 4 stages),
    checked to run here at D = ``hidden``."""
    from distmoe.kernels.w2_forward.gluon import gluon_w2_reason

    if stages is None:
        stages = 4 if warps == 8 else GLUON_W2.num_stages
    config = replace(GLUON_W2, block_n=block_n, num_warps=warps, num_stages=stages)
    reason = gluon_w2_reason(DEVICE, hidden=hidden, ffn=768, block_m=128, block_n=block_n,
                             block_k=64, stages=stages, warps=warps)
    assert reason is None, f"the Gluon W2 kernel would not run here: {reason}"
    return config


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, warps, stages, group_m",
                         [(128, 4, 5, 8), (128, 4, 4, 16), (128, 4, 6, 8), (128, 4, 3, 8),
                          (256, 8, 4, 8), (256, 8, 3, 16)])
def test_gpu_w2_gluon(block_n, warps, stages, group_m):
    # The Gluon kernel through w2_scatter (one program per SM), every tile and ring depth:
    # full and partial tiles, an empty expert padded to a whole tile, a padding-only tile,
    # one-row experts, live rows skipped (address 0, in both halves of a tile, and all of a
    # tile's), padding rows and idle tiles addressing a canary, NaN h2 rows past the live
    # ones.
    config = replace(_gluon_w2_tile(block_n, warps, stages), group_m=group_m)
    run_w2_case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP, config=config,
                min_rows=GLUON_W2_MIN_ROWS, skip_live=GLUON_W2_SKIP)


@pytest.mark.gpu
def test_gpu_w2_gluon_heuristic():
    """On a Hopper GPU with the layer's hint the heuristic picks the Gluon ping-pong tile from
    128 rows per expert at any EP size; fewer rows and widths it cannot tile keep the Triton
    kernel."""
    if torch.cuda.get_device_capability(DEVICE)[0] != 9:
        pytest.skip("the Gluon W2 is for compute capability 9.x")
    pick = partial(rules.w2_forward_config, device_class=device_class(DEVICE))
    tile = lambda c: (c.gluon, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=2048)) == (True, 128, 4, 6)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=256)) == (True, 128, 4, 6)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=128)) == (True, 128, 4, 6)
    assert not pick(hidden=2048, ffn=768, rows_per_expert=127).gluon
    assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=2048, ep_size=2)) == \
        (True, 128, 4, 6)
    assert tile(pick(hidden=2880, ffn=2880, rows_per_expert=2048)) == (True, 128, 4, 6)
    assert not pick(hidden=2912, ffn=2880, rows_per_expert=2048).gluon
    assert not rules.w2_forward_config(hidden=4096, ffn=2048, rows_per_expert=2048).gluon


@pytest.mark.gpu
@GLUON_W2_TILE_PARAMS
def test_gpu_w2_gluon_partial_column_tile(block_n, warps):
    # D = 1088, not a multiple of 128 or 256 (as GPT-OSS's 2880): each row's last tile is
    # partial; its weight rows past D are the next expert's (TMA zeros after the last), its
    # parts past D are not stored; run_w2_case's poisoned outputs and canaries show a store
    # past a row's end (the next row's first columns), and the reference every column.
    config = _gluon_w2_tile(block_n, warps, hidden=1088)
    run_w2_case(GLUON_COUNTS, hidden=1088, ffn=768, r_cap=GLUON_R_CAP, config=config,
                min_rows=GLUON_W2_MIN_ROWS, skip_live=GLUON_W2_SKIP)


def _w2_walk(config, programs, scale=1):
    """The Gluon W2 launched with ``programs`` programs over GLUON_COUNTS with every
    expert's rows times ``scale`` (poisoned outputs, canaries), against the reference."""
    from distmoe.kernels.w2_forward.gluon import launch_gluon_w2

    counts = [scale * n for n in GLUON_COUNTS]
    case = W2Case(counts, hidden=1024, ffn=768, block_m=128,
                  r_cap=sum(max(math.ceil(n / 128) * 128, m)
                            for n, m in zip(counts, GLUON_W2_MIN_ROWS, strict=True)) + 3 * 128,
                  min_rows=GLUON_W2_MIN_ROWS, skip_live=GLUON_W2_SKIP)
    layout = case.layout
    launch_gluon_w2(case.h2, layout.padded_offsets, layout.row_offsets, case.w2,
                    case.scatter_ptrs, enable=None, block_n=config.block_n,
                    stages=config.num_stages, warps=config.num_warps, programs=programs,
                    lockstep=config.lockstep, expert_groups=config.expert_groups)
    case.check()


@pytest.mark.gpu
@GLUON_W2_TILE_PARAMS
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_gpu_w2_gluon_programs_walk_many_tiles(block_n, warps, programs):
    # Few programs: each walks many tiles across expert boundaries, its ring's phases wrap
    # many times and ping-pong consumers take turns many times (odd counts included).
    _w2_walk(_gluon_w2_tile(block_n, warps), programs)


@pytest.mark.gpu
@GLUON_W2_TILE_PARAMS
@pytest.mark.parametrize("programs", [3, None, "twice_the_sms"])
def test_gpu_w2_gluon_lockstep(block_n, warps, programs):
    # W2Config.lockstep (as test_gpu_w13_gluon_lockstep): through w2_scatter with one
    # program per SM, few programs walking many tiles (the last wave's idle programs must
    # not hold the others' waits), and twice as many programs as SMs (the first half's waits
    # miss their bound, after which each stops waiting). Same rows as the reference.
    from distmoe.kernels.base.device import num_sms

    config = replace(_gluon_w2_tile(block_n, warps), lockstep=True)
    if programs is None:
        run_w2_case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP, config=config,
                    min_rows=GLUON_W2_MIN_ROWS, skip_live=GLUON_W2_SKIP)
    elif programs == "twice_the_sms":
        _w2_walk(config, 2 * num_sms(torch.device("cuda")), scale=8)
    else:
        _w2_walk(config, programs)


@pytest.mark.gpu
@GLUON_W2_TILE_PARAMS
@pytest.mark.parametrize("lockstep", [False, True], ids=["free", "lockstep"])
@pytest.mark.parametrize("programs", [1, 3, 7, None])
def test_gpu_w2_gluon_expert_groups(block_n, warps, lockstep, programs):
    # W2Config.expert_groups (as test_gpu_w13_gluon_expert_groups): each expert's tiles
    # walked column tile by column tile over its row blocks (1 to 16 of them here, an empty
    # expert padded to a whole tile, an expert whose last tile is padding only). A tile
    # missed or taken twice leaves a poisoned or wrong row, or writes a canary: few programs
    # walking many tiles, and through w2_scatter (None: one program per SM).
    config = replace(_gluon_w2_tile(block_n, warps), lockstep=lockstep, expert_groups=True)
    if programs is None:
        run_w2_case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP, config=config,
                    min_rows=GLUON_W2_MIN_ROWS, skip_live=GLUON_W2_SKIP)
    else:
        _w2_walk(config, programs, scale=2)


@pytest.mark.gpu
@GLUON_W2_TILE_PARAMS
def test_gpu_w2_gluon_enable(block_n, warps):
    # enable = 1 equals the run without it bit for bit; enable = 0 writes nothing anywhere.
    check_w2_enable(W2Case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP, block_m=128),
                    _gluon_w2_tile(block_n, warps), references=(False,))


def test_gluon_w2_config_reaches_the_launch(monkeypatch):
    """The W2 config's tile reaches the Gluon launch (``num_warps``, ``block_n``,
    ``num_stages``, ``group_m``) and the enable flag with it, on any machine: the launcher is
    a recorder and the check admits the case. ``gluon=False`` never calls either."""
    import distmoe.kernels.w2_forward.gluon as wg

    calls = []
    monkeypatch.setattr(wg, "gluon_w2_reason",
                        lambda device, **kw: calls.append(("reason", kw)) and None)
    monkeypatch.setattr(wg, "launch_gluon_w2", lambda *a, **kw: calls.append(("launch", kw)))
    case = W2Case([130, 0, 60], hidden=256, ffn=64, r_cap=3 * 128, block_m=128)
    enable = device_int([1], torch.int32)
    for warps, block_n, stages, group_m in ((4, 128, 6, 8), (8, 256, 3, 16)):
        calls.clear()
        config = replace(GLUON_W2, block_n=block_n, num_warps=warps, num_stages=stages,
                         group_m=group_m)
        case.run(config=config, enable=enable)
        (_, reason), (_, launch) = calls
        assert (reason["block_n"], reason["warps"], reason["stages"]) == (block_n, warps, stages)
        assert (launch["block_n"], launch["warps"], launch["stages"], launch["group_m"]) == (
            block_n, warps, stages, group_m)
        assert launch["enable"] is enable
        assert launch["lockstep"] is False and launch["expert_groups"] is False
    calls.clear()
    case.run(config=replace(GLUON_W2, lockstep=True), enable=enable)
    assert calls[1][1]["lockstep"] is True and calls[1][1]["expert_groups"] is False
    calls.clear()
    case.run(config=replace(GLUON_W2, expert_groups=True), enable=enable)
    assert calls[1][1]["expert_groups"] is True and calls[1][1]["lockstep"] is False
    for i, out in enumerate(case.outputs()):
        assert_untouched(out, what=f"output buffer {i} (the recorder launched nothing)")
    calls.clear()
    case.run(config=replace(GLUON_W2, gluon=False, block_m=128))
    assert calls == []
    case.check()


def test_w2_heuristic_takes_gluon_at_every_ep_size():
    """The plan's W2 forward rule on a Hopper device class: the Gluon tile from 128 rows per expert at EP=1 and EP=2 (run
    29, interleaved: faster at both), the Triton kernel's config below 128 rows and with no
    device."""
    pick = partial(rules.w2_forward_config, hidden=4096, ffn=2048, device_class="h100")
    gluon_cfg = rules.w2_forward_gluon(hidden=4096, ffn=2048, rows_per_expert=2048)
    assert gluon_cfg.gluon
    for ep in (1, 2, 4):
        assert pick(rows_per_expert=2048, ep_size=ep) == gluon_cfg
    triton_cfg = rules.w2_forward_config(hidden=4096, ffn=2048, rows_per_expert=2048)
    assert not triton_cfg.gluon
    assert pick(rows_per_expert=127) == rules.w2_forward_config(hidden=4096, ffn=2048,
                                                                rows_per_expert=127)
    assert not pick(rows_per_expert=127).gluon
    # the local expert count reaches the mid-rows rule (at D=4096 F=2048: below 128 experts)
    assert pick(rows_per_expert=96, num_experts=32) == gluon_cfg
    # the EP size reaches the expert-group rule (EP=1 only)
    assert pick(rows_per_expert=512).expert_groups
    assert not pick(rows_per_expert=512, ep_size=2).expert_groups
    assert not pick(rows_per_expert=96, num_experts=128).gluon


def test_gluon_w2_shape_rules_without_a_gpu():
    """The Gluon W2 kernel's tiles, ring depths and width rules, with their messages; on a
    CPU device (or in the interpreter) ``w2_scatter`` warns and runs the Triton kernel."""
    from distmoe.kernels.w2_forward.gluon import gluon_w2_reason, shape_reason, stage_bytes

    ok = dict(hidden=4096, ffn=2048, block_m=128, block_k=64)
    assert shape_reason(**ok, block_n=128, stages=6, warps=4) is None
    assert shape_reason(**ok, block_n=256, stages=4, warps=8) is None
    assert stage_bytes(128) == 32 * 1024 and stage_bytes(256) == 48 * 1024
    assert "num_warps 4: ping-pong 128 x 128" in shape_reason(**ok, block_n=256, stages=4,
                                                              warps=4)
    assert "stages must be one of [3, 4] with block_n = 256" in shape_reason(
        **ok, block_n=256, stages=5, warps=8)
    assert "D (4000) must be a multiple of 64 and F (2048) of 64" in shape_reason(
        hidden=4000, ffn=2048, block_m=128, block_k=64, block_n=128, stages=5, warps=4)
    assert "F (2000)" in shape_reason(hidden=4096, ffn=2000, block_m=128, block_k=64,
                                      block_n=128, stages=5, warps=4)
    assert gluon_w2_reason(torch.device("cpu"), **ok, block_n=128, stages=5) is not None
    # what the Hopper heuristic picks (device-independent): ping-pong, 6 stages, from 128
    # rows per expert where the widths tile; no device or a CPU device keeps Triton
    tile = lambda c: (c.gluon, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    for rows in (128, 256, 512, 2048):
        assert tile(rules.w2_forward_gluon(hidden=4096, ffn=2048, rows_per_expert=rows)) == \
            (True, 128, 4, 6)
    assert rules.w2_forward_gluon(hidden=4096, ffn=2048, rows_per_expert=127) is None
    assert rules.w2_forward_gluon(hidden=2048, ffn=768, rows_per_expert=96) is None
    # its producers in lockstep at 128-191 rows per expert where an expert's W2 weights hold
    # at least 8 MiB (run 52): D=4096 F=1024 is exactly that, D=2048 F=768 (3 MiB) not
    lockstep = lambda rows, hidden=4096, ffn=1024: rules.w2_forward_gluon(  # noqa: E731
        hidden=hidden, ffn=ffn, rows_per_expert=rows).lockstep
    assert lockstep(128) and lockstep(191) and lockstep(128, 2880, 2880)
    assert not any(lockstep(rows) for rows in (192, 256, 2048))
    assert not lockstep(128, 4096, 960) and not lockstep(128, 2048, 768)
    assert not rules.w2_forward_gluon(hidden=4096, ffn=1024, rows_per_expert=96,
                                     num_experts=32).lockstep  # mid rows
    # the expert-group tile order at EP=1 from 128 to 1024 rows per expert (run 59: the
    # forward 1.010-1.041x there, 0.967x at 2048; run 60: in training too)
    groups = lambda rows, **kw: rules.w2_forward_gluon(  # noqa: E731
        hidden=4096, ffn=2048, rows_per_expert=rows, **kw).expert_groups
    assert groups(128) and groups(512) and groups(1024)
    assert not any(groups(rows) for rows in (1025, 2048))
    assert not groups(96, num_experts=32)  # mid rows: not measured
    assert not any(groups(rows, ep_size=2) for rows in (128, 512, 1024))
    # 64-127 rows per expert: Gluon where the local experts are given and their W2 weights
    # total less than 2 GiB (run 38; 128 experts at D=4096 F=2048 are exactly that); below
    # 64 Triton whatever the count
    for rows, experts, hidden in ((64, 128, 2048), (127, 64, 2048), (96, 127, 4096)):
        assert tile(rules.w2_forward_gluon(hidden=hidden, ffn=2048, rows_per_expert=rows,
                                          num_experts=experts)) == (True, 128, 4, 6)
    for rows, experts, hidden in ((96, 256, 4096), (96, 128, 4096), (96, 128, 7168),
                                  (63, 8, 2048), (96, None, 2048)):
        assert rules.w2_forward_gluon(hidden=hidden, ffn=2048, rows_per_expert=rows,
                                     num_experts=experts) is None
    assert tile(rules.w2_forward_gluon(hidden=4096, ffn=2048, rows_per_expert=2048,
                                      ep_size=2)) == (True, 128, 4, 6)
    # D = 2880 (GPT-OSS): each row's last column tile partial
    assert tile(rules.w2_forward_gluon(hidden=2880, ffn=2880, rows_per_expert=2048)) == \
        (True, 128, 4, 6)
    assert rules.w2_forward_gluon(hidden=2912, ffn=2880, rows_per_expert=2048) is None
    # at 64-127 rows per expert only where 128 divides D (run 49: 0.8-0.9% slower at 2880)
    assert rules.w2_forward_gluon(hidden=2880, ffn=2880, rows_per_expert=64,
                                 num_experts=32) is None
    assert tile(rules.w2_forward_gluon(hidden=2944, ffn=2880, rows_per_expert=128,
                                      num_experts=32)) == (True, 128, 4, 6)
    assert rules.w2_forward_gluon(hidden=2048, ffn=200, rows_per_expert=2048) is None
    for device in (None, torch.device("cpu")):
        assert not rules.w2_forward_config(hidden=4096, ffn=2048, rows_per_expert=2048,
                                           device_class=device_class(device)).gluon
    if DEVICE.type == "cpu":
        case = W2Case([5, 0, 21], hidden=128, ffn=64, r_cap=3 * 128, block_m=128)
        with pytest.warns(RuntimeWarning, match="w2_scatter: config.gluon is set"):
            case.run(config=GLUON_W2)
        case.check()
