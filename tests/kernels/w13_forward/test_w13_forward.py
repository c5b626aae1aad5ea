"""W13 gather + SwiGLU forward (Triton and Gluon) against the plain-PyTorch reference.

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
    build_layout,
    device_int,
    poisoned,
    random_weights,
)

from distmoe.kernels.w13_forward.config import W13Config
from distmoe.kernels.w13_forward.triton import gather_w13_swiglu, gather_w13_swiglu_ref
from distmoe.plan import device_class, rules


def peer_sources(hidden: int) -> list[torch.Tensor]:
    """Several source tensors standing in for peers' dispatch buffers (one a row slice of a
    larger buffer, one 3-D [T, K, D])."""
    big = torch.randn(20, hidden, device=DEVICE).to(torch.bfloat16)
    return [
        torch.randn(11, hidden, device=DEVICE).to(torch.bfloat16),
        torch.randn(4, 3, hidden, device=DEVICE).to(torch.bfloat16),
        big[5:12],
    ]


def gather_table(layout, r_cap, sources, hidden, *, garbage=None, null_live=()):
    """gather_ptrs for the live rows (random rows of random sources) and the fp64 rows in
    activation-row order. Live rows listed in ``null_live`` (activation rows) get address 0;
    padding rows and rows beyond ``padded[-1]`` point at ``garbage`` (NaN rows) when given,
    which the kernel must never read."""
    ptrs = torch.zeros(r_cap, dtype=torch.int64)
    if garbage is not None:
        for r in range(r_cap):
            ptrs[r] = addr(garbage, r % garbage.shape[0], hidden)
    x = torch.zeros(layout.num_act, hidden, dtype=torch.float64)
    a = 0
    for rows in layout.live:
        for r in rows:
            if a in null_live:
                ptrs[r] = 0
            else:
                i = int(torch.randint(len(sources), ()))
                src = sources[i].reshape(-1, hidden)
                j = int(torch.randint(src.shape[0], ()))
                ptrs[r] = addr(sources[i], j, hidden)
                x[a] = src[j].double().cpu()
            a += 1
    return ptrs.to(DEVICE), x


def w13_expected(x, w13, layout):
    """fp64 g, u, h2 of the activation rows ``[0, row_offsets[-1])``."""
    ffn = w13.shape[2]
    g = torch.zeros(layout.num_act, ffn, dtype=torch.float64)
    u = torch.zeros(layout.num_act, ffn, dtype=torch.float64)
    for e in range(len(layout.live)):
        rows = slice(layout.act[e], layout.act[e + 1])
        g[rows] = x[rows] @ w13[e, 0].double().cpu().T
        u[rows] = x[rows] @ w13[e, 1].double().cpu().T
    return g, u, torch.nn.functional.silu(g) * u


class W13Case:
    """Inputs of one W13 call and their fp64 expectation (activation rows)."""

    def __init__(self, counts, *, hidden, ffn, r_cap, block_m=BM, min_rows=None, null_live=()):
        self.hidden, self.ffn, self.r_cap = hidden, ffn, r_cap
        self.layout = build_layout(counts, r_cap=r_cap, block_m=block_m, min_rows=min_rows)
        self.sources = peer_sources(hidden)
        self.garbage = poisoned(3, hidden)
        self.gather_ptrs, self.x = gather_table(
            self.layout, r_cap, self.sources, hidden, garbage=self.garbage, null_live=null_live
        )
        self.null_live = list(null_live)
        self.w13, _ = random_weights(len(counts), hidden, ffn)
        self.g, self.u, self.h2 = w13_expected(self.x, self.w13, self.layout)

    def run(self, h2_out, *, config, use_ref=False, **kwargs):
        args = (self.gather_ptrs, self.layout.padded_offsets, self.layout.row_offsets, self.w13)
        if use_ref:
            gather_w13_swiglu_ref(
                *args, h2_out, sources=self.sources, block_m=config.block_m, **kwargs
            )
        else:
            gather_w13_swiglu(*args, h2_out, config=config, **kwargs)

    def check_rows(self, name, rows, *, tail=None):
        """``rows``: the ``row_offsets[-1]`` activation rows of output ``name``; ``tail``:
        what lies beyond them in the same tensor (must be untouched)."""
        n = self.layout.num_act
        if name == "h2":
            assert_bf16_close(rows, self.h2, what="h2")
        elif name == "h1":
            assert_bf16_close(rows, torch.cat([self.g, self.u], dim=1), what="h1")
        else:
            # The saved rows are a bit-exact copy of the gathered bf16 rows.
            assert torch.equal(rows.double().cpu(), self.x), "x_out is not the gathered rows"
        if self.null_live:
            # Live rows with a null address read zeros: their outputs are exact zeros.
            assert not rows[self.null_live].float().any(), f"{name}: null rows not zero"
        if tail is not None:
            assert_untouched(tail, what=f"{name} beyond row_offsets[-1] ({n})")

    def check_saved(self, saved):
        """``saved``: ``(name, base, offset, width)`` per output stored into a 1-D ``base`` at
        an element ``offset`` (negative: not stored). Each stored output's rows land at its
        offset, and every other element of every base (bases may be shared) stays poisoned."""
        n = self.layout.num_act
        bases = {id(base): base for _, base, _, _ in saved}
        written = {key: torch.zeros(base.numel(), dtype=torch.bool) for key, base in bases.items()}
        for name, base, off, width in saved:
            if off < 0:
                continue
            self.check_rows(name, base[off : off + n * width].view(n, width))
            written[id(base)][off : off + n * width] = True
        for key, base in bases.items():
            assert_untouched(base[~written[key].to(DEVICE)], what="base outside saved ranges")


def run_w13_case(
    counts, *, hidden, ffn, r_cap, config, min_rows=None, training=True, use_ref=False,
    act_slack=3, null_live=(),
):  # fmt: skip
    case = W13Case(
        counts, hidden=hidden, ffn=ffn, r_cap=r_cap, block_m=config.block_m, min_rows=min_rows,
        null_live=null_live,
    )  # fmt: skip
    n = case.layout.num_act
    r_act = n + act_slack  # activation rows: independent of R_cap
    h2 = poisoned(r_act, ffn)
    h1 = poisoned(r_act, 2 * ffn) if training else None
    x_out = poisoned(r_act, hidden) if training else None
    case.run(h2, h1_out=h1, x_out=x_out, config=config, use_ref=use_ref)
    case.check_rows("h2", h2[:n], tail=h2[n:])
    if training:
        case.check_rows("h1", h1[:n], tail=h1[n:])
        case.check_rows("x", x_out[:n], tail=x_out[n:])
    return case


@GRIDS
def test_w13_mixed_experts(persistent, host_descriptors):
    # Experts with 5, 0, 16 and 21 live rows (padding after 5 and 21, one empty, one exactly
    # one tile), peers' rows from three sources, a live row with a null address, padding
    # rows' gather entries pointing at NaN rows (never read), F=48 not a multiple of
    # block_n=32, two idle tiles, three activation rows beyond row_offsets[-1].
    config = replace(W13_SMALL, persistent=persistent, host_descriptors=host_descriptors)
    run_w13_case([5, 0, 16, 21], hidden=64, ffn=48, r_cap=96, config=config, null_live=[7])


@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_w13_tma_epilogue(host_descriptors, training):
    # Full tiles store through the program's TMA descriptors, partial ones through pointers:
    # experts of 16 and 32 live rows (one and two full tiles) beside 5 and 21 (a partial last
    # tile that must not spill into the next expert's rows), an empty one, a null row in a
    # full tile; three poisoned activation rows past the live ones must stay untouched (the
    # descriptors end at row_offsets[-1]). On the interpreter's 3 programs, the 5-row tile's
    # second column tile runs after expert 1's (checked by mutation: a box store from the
    # partial tile overwrites rows that were already final).
    config = replace(W13_SMALL, persistent=True, host_descriptors=host_descriptors,
                     tma_epilogue=True)
    run_w13_case([5, 16, 0, 32, 21], hidden=64, ffn=64, r_cap=160, config=config,
                 training=training, null_live=[8])


@pytest.mark.parametrize("hidden, ffn", [(96, 48), (32, 96), (72, 80)],
                         ids=["more_k_steps", "more_column_tiles", "both_ragged"])
def test_w13_x_out_shared_by_column_tiles(hidden, ffn):
    # The column tiles of a row tile share the copy of its gathered rows (tile n copies the K
    # steps n, n + tiles, ...): 3 K steps over 2 column tiles, 1 K step over 3 column tiles,
    # and ragged D and F (3 K steps, the last partial, over 3 column tiles, the last partial).
    run_w13_case([9, 0, 23], hidden=hidden, ffn=ffn, r_cap=64, config=W13_SMALL)


def test_w13_hidden_not_multiple_of_block_k():
    # D=40 against block_k=32: the last K step is masked (rows) / zero-filled (TMA weights).
    run_w13_case([7, 18], hidden=40, ffn=32, r_cap=64, config=W13_SMALL)


def test_w13_one_expert_all_rows():
    # Every row goes to the last of three experts; R_cap exactly full (no idle tile); the
    # activations hold exactly row_offsets[-1] rows (no slack).
    run_w13_case([0, 0, 37], hidden=32, ffn=32, r_cap=48, config=W13_SMALL, act_slack=0)


def test_w13_padding_tile_and_inference():
    # Expert 1 is empty but padded to a whole tile of padding rows (nothing stored: its
    # activation row range is empty); inference: no h1/x_out.
    run_w13_case(
        [3, 0, 9],
        hidden=32,
        ffn=64,
        r_cap=64,
        config=W13_SMALL,
        min_rows=[0, 16, 0],
        training=False,
    )


@PERSISTENT
def test_w13_no_rows(persistent):
    # No routed rows at all: every tile is idle and nothing is written.
    r_cap, hidden, ffn = 32, 32, 32
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    gather_ptrs = torch.zeros(r_cap, dtype=torch.int64, device=DEVICE)
    w13, _ = random_weights(2, hidden, ffn)
    h2, h1, x_out = poisoned(4, ffn), poisoned(4, 2 * ffn), poisoned(4, hidden)
    config = replace(W13_SMALL, persistent=persistent)
    gather_w13_swiglu(
        gather_ptrs, offsets, offsets.clone(), w13, h2, h1_out=h1, x_out=x_out, config=config
    )
    for name, out in (("h2", h2), ("h1", h1), ("x_out", x_out)):
        assert_untouched(out, what=name)


@pytest.mark.parametrize("tma_epilogue", [False, True], ids=["pointer_stores", "tma_epilogue"])
def test_w13_empty_padding_only_layout(tma_epilogue):
    # Live rows only in the middle expert, whose count (1) leaves 15 padding rows; empty
    # experts on both sides padded to whole tiles. Only activation row 0 may be written.
    config = replace(W13_SMALL, persistent=tma_epilogue, tma_epilogue=tma_epilogue)
    run_w13_case([0, 1, 0], hidden=32, ffn=32, r_cap=64, config=config, min_rows=[16, 0, 16])


def test_w13_tma_epilogue_padding_tiles_only():
    # Padded tiles but no live row at all (row_offsets[-1] = 0): the TMA epilogue's
    # descriptors still get a nonzero extent, and nothing is written.
    config = replace(W13_SMALL, persistent=True, tma_epilogue=True)
    padded = torch.tensor([0, 16, 32], dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    w13, _ = random_weights(2, 32, 32)
    h2, h1, x_out = poisoned(4, 32), poisoned(4, 64), poisoned(4, 32)
    gather_w13_swiglu(torch.zeros(32, dtype=torch.int64, device=DEVICE), padded, rows, w13, h2,
                      h1_out=h1, x_out=x_out, config=config)
    for name, out in (("h2", h2), ("h1", h1), ("x_out", x_out)):
        assert_untouched(out, what=name)


def test_w13_default_config_from_block_m():
    # config=None: the heuristic config at the caller's padding multiple.
    case = W13Case([4, 20], hidden=32, ffn=32, r_cap=48)
    n = case.layout.num_act
    h2 = poisoned(n + 2, 32)
    gather_w13_swiglu(
        case.gather_ptrs, case.layout.padded_offsets, case.layout.row_offsets, case.w13, h2,
        block_m=BM,
    )  # fmt: skip
    case.check_rows("h2", h2[:n], tail=h2[n:])


def test_w13_reference():
    # The plain-PyTorch reference obeys the same contract (within the same tolerance).
    run_w13_case(
        [5, 0, 21], hidden=32, ffn=48, r_cap=64, config=W13_SMALL, use_ref=True, null_live=[2]
    )


OUT_OFFSET_CASES = pytest.mark.parametrize(
    "h1_at, x_at, same_base",
    [
        (8, 24, True),  # both saved into one base, x after h1 with a gap
        (-1, 16, True),  # h1 skipped
        (40, -8, True),  # x skipped
        (-1, -1, True),  # nothing saved (h2 still written)
        (64, 8, False),  # separate bases
    ],
    ids=["both", "h1_skipped", "x_skipped", "none", "separate_bases"],
)


@OUT_OFFSET_CASES
@pytest.mark.parametrize("impl", ["kernel", "reference", "kernel_tma_epilogue"])
def test_w13_out_offsets(h1_at, x_at, same_base, impl):
    # h1 / x stored at device-side element offsets into poisoned 1-D bases: exactly the
    # row_offsets[-1] rows of each saved output land at its offset; a negative offset
    # writes nothing for that output; every other element of the bases stays poisoned.
    # ``h1_at`` / ``x_at``: element offsets; x's is relative to the end of h1's range when
    # both share one base (so the ranges do not overlap). ``kernel_tma_epilogue``: full
    # tiles (experts of 16 and 32 rows) store through descriptors built at those offsets.
    config = W13_SMALL
    if impl == "kernel_tma_epilogue":
        config = replace(W13_SMALL, persistent=True, tma_epilogue=True)
        case = W13Case([5, 16, 32], hidden=32, ffn=64, r_cap=96, null_live=[20])
    else:
        case = W13Case([5, 0, 19], hidden=32, ffn=48, r_cap=64, null_live=[3])
    n, ffn, hidden = case.layout.num_act, case.ffn, case.hidden
    h1_size, x_size = n * 2 * ffn, n * hidden
    if same_base:
        x_off = -1 if x_at < 0 else max(h1_at, 0) + h1_size + x_at
        h1_base = x_base = poisoned(max(h1_at, 0) + h1_size + x_at + x_size + 40)
    else:
        x_off = x_at
        h1_base, x_base = poisoned(h1_at + h1_size + 24), poisoned(x_at + x_size + 24)
    h1_off = h1_at
    h2 = poisoned(n + 1, ffn)
    case.run(
        h2,
        h1_out=h1_base,
        x_out=x_base,
        out_offsets=device_int([h1_off, x_off], torch.int64),
        config=config,
        use_ref=impl == "reference",
    )
    case.check_rows("h2", h2[:n], tail=h2[n:])
    case.check_saved([("h1", h1_base, h1_off, 2 * ffn), ("x", x_base, x_off, hidden)])


@PERSISTENT
def test_w13_enable(persistent):
    # enable = 1 equals the plain run bit for bit; enable = 0 writes nothing anywhere (the
    # same for the reference).
    config = replace(W13_SMALL, persistent=persistent)
    case = W13Case([6, 0, 17], hidden=32, ffn=32, r_cap=64, null_live=[0])
    n = case.layout.num_act

    def outputs():
        return poisoned(n + 2, 32), poisoned(n + 2, 64), poisoned(n + 2, 32)

    plain = outputs()
    case.run(plain[0], h1_out=plain[1], x_out=plain[2], config=config)
    case.check_rows("h2", plain[0][:n], tail=plain[0][n:])
    on = outputs()
    case.run(on[0], h1_out=on[1], x_out=on[2], config=config, enable=device_int([1], torch.int32))
    for name, got, want in zip(("h2", "h1", "x_out"), on, plain, strict=True):
        assert_bits_equal(got, want, what=f"{name} with enable=1")
    for use_ref in (False, True):
        off = outputs()
        base = poisoned(n * 96 + 16)
        case.run(
            off[0], h1_out=off[1], x_out=off[2], config=config, use_ref=use_ref,
            enable=device_int([0], torch.int32),
        )  # fmt: skip
        case.run(
            off[0], h1_out=base, x_out=base, out_offsets=device_int([0, n * 64], torch.int64),
            config=config, use_ref=use_ref, enable=device_int([0], torch.int32),
        )  # fmt: skip
        for name, out in (("h2", off[0]), ("h1", off[1]), ("x_out", off[2]), ("base", base)):
            assert_untouched(out, what=f"{name} with enable=0 ({'ref' if use_ref else 'kernel'})")


def _w13_inputs(r_cap=32, hidden=32, ffn=32, num_experts=2):
    w13, _ = random_weights(num_experts, hidden, ffn)
    return dict(
        gather_ptrs=torch.zeros(r_cap, dtype=torch.int64, device=DEVICE),
        padded_offsets=torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE),
        row_offsets=torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE),
        w13=w13,
        h2_out=poisoned(5, ffn),
    )


def _with_bases(**extra):
    """An update that switches to the out_offsets path (valid unless ``extra`` breaks it)."""

    def change(a):
        a.update(h1_out=poisoned(64), x_out=poisoned(64))
        a.update(out_offsets=torch.zeros(2, dtype=torch.int64, device=DEVICE))
        a.update(**extra)

    return change


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(gather_ptrs=a["gather_ptrs"].int()), TypeError, "gather_ptrs must have dtype int64"),
        (lambda a: a.update(w13=a["w13"].float()), TypeError, "w13 must have dtype bfloat16"),
        (lambda a: a.update(w13=a["w13"][:, :1].contiguous()), ValueError, r"w13 must have shape \[E_local >= 1, 2, F, D\]"),
        (lambda a: a.update(w13=a["w13"][..., :12].contiguous()), ValueError, r"D \(hidden\) \(12\) must be a positive multiple of 8"),
        (lambda a: a.update(w13=a["w13"].transpose(2, 3)), ValueError, "w13 must be contiguous"),
        (lambda a: a.update(padded_offsets=a["padded_offsets"][:2]), ValueError, r"padded_offsets must have shape \[3\]"),
        (lambda a: a.update(padded_offsets=a["padded_offsets"].long()), TypeError, "padded_offsets must have dtype int32"),
        (lambda a: a.update(row_offsets=a["row_offsets"].long()), TypeError, "row_offsets must have dtype int32, got torch.int64"),
        (lambda a: a.update(row_offsets=a["row_offsets"][:2]), ValueError, r"row_offsets must have shape \[3\] \[E_local \+ 1\] \(live rows per expert, exclusive prefix sum\), got \[2\]"),
        (lambda a: a.update(row_offsets=META_I32), ValueError, r"row_offsets must be on the same device as gather_ptrs \((cpu|cuda:\d+)\), got meta"),
        (lambda a: a.update(h2_out=a["h2_out"][:, :16].contiguous()), ValueError, r"h2_out must have shape \[R_act, F=32\]"),
        (lambda a: a.update(h2_out=poisoned(0, 32)), ValueError, r"h2_out must have R_act >= 1 rows .* got shape \[0, 32\]"),
        (lambda a: a.update(h2_out=poisoned(160)), ValueError, r"h2_out must be 2-D \[R_act, F\], got shape \[160\]"),
        (lambda a: a.update(h1_out=poisoned(32, 32)), ValueError, r"h1_out must have shape \[R_act, 2F=64\]"),
        (lambda a: a.update(h1_out=poisoned(0, 64)), ValueError, r"h1_out must have R_act >= 1 rows"),
        (lambda a: a.update(h1_out=poisoned(64)), ValueError, r"h1_out must be 2-D \[R_act, 2F\]"),
        (lambda a: a.update(x_out=poisoned(32, 32).float()), TypeError, "x_out must have dtype bfloat16"),
        (_with_bases(out_offsets=torch.zeros(2, dtype=torch.int32, device=DEVICE)), TypeError, "out_offsets must have dtype int64, got torch.int32"),
        (_with_bases(out_offsets=torch.zeros(3, dtype=torch.int64, device=DEVICE)), ValueError, r"out_offsets must have shape \[2\] \(h1, x\), got \[3\]"),
        (_with_bases(out_offsets=torch.zeros(2, dtype=torch.int64, device="meta")), ValueError, "out_offsets must be on the same device as gather_ptrs"),
        (_with_bases(x_out=None), ValueError, "x_out must be given with out_offsets"),
        (_with_bases(h1_out=None), ValueError, "h1_out must be given with out_offsets"),
        (_with_bases(h1_out=poisoned(4, 64)), ValueError, r"h1_out must be 1-D \(a bf16 base\), got shape \[4, 64\]"),
        (_with_bases(x_out=poisoned(64).float()), TypeError, "x_out must have dtype bfloat16"),
        (_with_bases(x_out=poisoned(64)[1:]), ValueError, "x_out must start at a 16-byte aligned address"),
        (lambda a: a.update(enable=torch.ones(1, dtype=torch.int64, device=DEVICE)), TypeError, "enable must have dtype int32, got torch.int64"),
        (lambda a: a.update(enable=torch.ones((), dtype=torch.int32, device=DEVICE)), ValueError, r"enable must have shape \[1\] \(0 = skip\), got \[\]"),
        (lambda a: a.update(enable=torch.ones(1, dtype=torch.int32, device="meta")), ValueError, "enable must be on the same device as gather_ptrs"),
        (lambda a: a.update(gather_ptrs=a["gather_ptrs"][:24]), ValueError, r"R_cap \(24, rows of gather_ptrs\) must be a multiple of block_m \(16\)"),
        (lambda a: a.update(block_m=32), ValueError, r"block_m \(32\) must equal config.block_m \(16\)"),
        (lambda a: a.update(config=W2_SMALL), TypeError, "config must be a W13Config"),
    ],
)  # fmt: skip
def test_w13_rejects_bad_inputs(change, error, match):
    args = _w13_inputs()
    args["config"] = W13_SMALL
    change(args)
    with pytest.raises(error, match=match):
        gather_w13_swiglu(**args)


def test_w13_reference_rejects_bad_layout():
    # The reference checks the device-side layout on the host (the kernel cannot).
    args = _w13_inputs()
    args["padded_offsets"] = device_int([0, 16, 16], torch.int32)
    args["row_offsets"] = device_int([0, 17, 17], torch.int32)
    with pytest.raises(ValueError, match=r"expert 0 17 live rows; must be in \[0, 16\]"):
        gather_w13_swiglu_ref(**args, sources=[], block_m=BM)
    args["padded_offsets"] = device_int([0, 16, 32], torch.int32)
    args["row_offsets"] = device_int([0, 7, 9], torch.int32)
    with pytest.raises(ValueError, match=r"row_offsets\[-1\] \(9\) must be <= R_act \(5"):
        gather_w13_swiglu_ref(**args, sources=[], block_m=BM)


@pytest.mark.gpu
@GRIDS
def test_gpu_w13_hopper_tiles(persistent, host_descriptors):
    # Default 128x128x64 tiles, F=768 (6 column tiles), skewed experts incl. an empty one.
    config = rules.w13_forward_config(hidden=1024, ffn=768)
    config = replace(config, persistent=persistent, host_descriptors=host_descriptors)
    counts = [300, 0, 129, 1000, 1, 64, 128, 511]
    r_cap = sum(math.ceil(n / 128) * 128 for n in counts) + 3 * 128
    run_w13_case(counts, hidden=1024, ffn=768, r_cap=r_cap, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("host_descriptors", [True, False], ids=["host_desc", "device_desc"])
@pytest.mark.parametrize("stages, group_m", [(3, 8), (4, 16)])
def test_gpu_w13_hopper_tiles_tma_epilogue(host_descriptors, stages, group_m):
    # The TMA epilogue at Hopper tiles: full tiles (128, 1000 = 7 full + 1 partial, 128)
    # next to partial ones, an empty expert, training outputs; the tile-grid fallback is
    # covered above.
    config = W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=stages,
                       group_m=group_m, persistent=True, host_descriptors=host_descriptors,
                       tma_epilogue=True)
    counts = [300, 0, 128, 1000, 1, 64, 128, 511]
    r_cap = sum(math.ceil(n / 128) * 128 for n in counts) + 3 * 128
    run_w13_case(counts, hidden=1024, ffn=768, r_cap=r_cap, config=config, null_live=[5])


# the warp-specialised Gluon kernel (w13_gluon): 128 x 64 h2 tiles per consumer warpgroup
GLUON_W13 = W13Config(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=5,
                      group_m=8, persistent=True, gluon=True)


# the three tiles: ping-pong 128 x 64 and 64 x 128 h2, cooperative 128 x 128 (num_warps 8)
GLUON_TILES = pytest.mark.parametrize("block_n, warps", [(64, 4), (128, 4), (128, 8)],
                                      ids=["128x64", "64x128", "128x128coop"])


def _gluon_tile(block_n, warps):
    """GLUON_W13 with the tile of GLUON_TILES (the cooperative one takes at most 4 stages)."""
    return replace(GLUON_W13, block_n=block_n, num_warps=warps,
                   num_stages=4 if warps == 8 else GLUON_W13.num_stages)


def _assert_gluon_w13_runs(config, *, hidden=1024, ffn=768):
    from distmoe.kernels.w13_forward.gluon import gluon_w13_reason

    reason = gluon_w13_reason(DEVICE, hidden=hidden, ffn=ffn, block_m=config.block_m,
                              block_n=config.block_n, block_k=config.block_k,
                              stages=config.num_stages, warps=config.num_warps)
    assert reason is None, f"the Gluon W13 kernel would not run here: {reason}"


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("block_n, stages, group_m, warps",
                         [(64, 5, 8, 4), (64, 3, 16, 4), (64, 4, 8, 4), (64, 6, 8, 4),
                          (128, 4, 8, 4), (128, 3, 16, 4), (128, 5, 8, 4), (128, 4, 8, 8),
                          (128, 3, 16, 8)])
def test_gpu_w13_gluon(training, block_n, stages, group_m, warps):
    # The Gluon kernel through gather_w13_swiglu (one program per SM): the three tiles, the
    # ring depths they take, group-M orders.
    config = replace(GLUON_W13, block_n=block_n, num_stages=stages, group_m=group_m,
                     num_warps=warps)
    _assert_gluon_w13_runs(config)
    run_w13_case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP, config=config,
                 training=training, null_live=[5])


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("block_n, warps", [(128, 4), (128, 8)], ids=["64x128", "128x128coop"])
def test_gpu_w13_gluon_partial_column_tile(training, block_n, warps):
    # F = 832, not a multiple of the 128 h2 columns of a tile (as GPT-OSS's 2880): each row's
    # last tile is partial, its gate weight rows past F the expert's up rows, its up rows
    # past F the next expert's gate rows (TMA zeros after the last), its column half past F
    # not stored; run_w13_case's poisoned h2 / h1 / saved rows and the reference show a
    # store past F (into h1's u half, or the next h2 row) or a wrong column.
    config = _gluon_tile(block_n, warps)
    _assert_gluon_w13_runs(config, ffn=832)
    run_w13_case(GLUON_COUNTS, hidden=1024, ffn=832, r_cap=GLUON_R_CAP, config=config,
                 training=training, null_live=[5])


@pytest.mark.gpu
@GLUON_TILES
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_gpu_w13_gluon_programs_walk_many_tiles(block_n, warps, programs):
    # Few programs: each walks many tiles, its load stream crossing tile and expert
    # boundaries, its ring's phases wrapping many times, and ping-pong consumers taking
    # turns many times (odd tile counts per program included).
    _walk_many_tiles(_gluon_tile(block_n, warps), programs)


def _walk_many_tiles(config, programs, scale=1):
    """The Gluon W13 launched with ``programs`` programs (h1 and the rows stored, poisoned
    outputs and tails), every row against the reference; ``scale`` multiplies the rows of
    every expert of GLUON_COUNTS (more tiles)."""
    from distmoe.kernels.w13_forward.gluon import launch_gluon_w13

    _assert_gluon_w13_runs(config)
    counts = [scale * n for n in GLUON_COUNTS]
    case = W13Case(counts, hidden=1024, ffn=768, block_m=128, null_live=[5, 700],
                   r_cap=sum(math.ceil(n / 128) * 128 for n in counts) + 3 * 128)
    n = case.layout.num_act
    h2, h1, x_out = poisoned(n + 3, 768), poisoned(n + 3, 1536), poisoned(n + 3, 1024)
    launch_gluon_w13(case.gather_ptrs, case.layout.padded_offsets, case.layout.row_offsets,
                     case.w13, h2, h1_out=h1, x_out=x_out, out_offsets=None, enable=None,
                     block_n=config.block_n, stages=config.num_stages, warps=config.num_warps,
                     programs=programs, lockstep=config.lockstep,
                     expert_groups=config.expert_groups)
    case.check_rows("h2", h2[:n], tail=h2[n:])
    case.check_rows("h1", h1[:n], tail=h1[n:])
    case.check_rows("x", x_out[:n], tail=x_out[n:])


@pytest.mark.gpu
@GLUON_TILES
@pytest.mark.parametrize("lockstep", [False, True], ids=["free", "lockstep"])
@pytest.mark.parametrize("programs", [1, 3, 7, None])
def test_gpu_w13_gluon_expert_groups(block_n, warps, lockstep, programs):
    # W13Config.expert_groups: each expert's tiles walked column tile by column tile over
    # its row blocks (1 to 16 of them here, an empty expert between), in place of group-M
    # order. A tile missed or taken twice leaves poisoned rows or a wrong one: every row
    # against the reference, with few programs walking many tiles, and through
    # gather_w13_swiglu (None: one program per SM) in training and inference.
    config = replace(_gluon_tile(block_n, warps), lockstep=lockstep, expert_groups=True)
    if programs is None:
        _assert_gluon_w13_runs(config)
        for training in (True, False):
            run_w13_case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP,
                         config=config, training=training, null_live=[5])
    else:
        _walk_many_tiles(config, programs, scale=2)


@pytest.mark.gpu
@GLUON_TILES
@pytest.mark.parametrize("programs", [3, None, "twice_the_sms"])
def test_gpu_w13_gluon_lockstep(block_n, warps, programs):
    # W13Config.lockstep: each producer waits on a device counter for the wave before each
    # tile after its first; the last wave's programs with no tile leave, so the others' waits
    # must count only the tiles that exist (else each spins to its bound). Same rows as the
    # reference, poisoned outputs, through gather_w13_swiglu (one program per SM), with few
    # programs walking many tiles, and with twice as many programs as SMs (one fits an SM:
    # the second half waits for the first to leave, so the first half's waits miss their
    # bound; each then stops waiting, and the rows are the same).
    from distmoe.kernels.base.device import num_sms

    config = replace(_gluon_tile(block_n, warps), lockstep=True)
    if programs is None:
        _assert_gluon_w13_runs(config)
        run_w13_case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP, config=config,
                     training=True, null_live=[5])
    elif programs == "twice_the_sms":
        _walk_many_tiles(config, 2 * num_sms(torch.device("cuda")), scale=4)
    else:
        _walk_many_tiles(config, programs)


@pytest.mark.gpu
@GLUON_TILES
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_gpu_w13_gluon_many_experts(block_n, warps, training):
    # 200 local experts: above the 128 whose bounds the producer holds in registers (it
    # loads them per tile there). Empty and one-row experts, whole and partial tiles, a
    # live row with a null address.
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 300, (200,), generator=gen)
    counts[::7] = 0
    counts[3::11] = 1
    counts[5::13] = 128
    counts = counts.tolist()
    r_cap = sum(math.ceil(n / 128) * 128 for n in counts) + 2 * 128
    config = _gluon_tile(block_n, warps)
    _assert_gluon_w13_runs(config, hidden=512, ffn=256)
    run_w13_case(counts, hidden=512, ffn=256, r_cap=r_cap, config=config, training=training,
                 null_live=[3])


@pytest.mark.gpu
@GLUON_TILES
@pytest.mark.parametrize("h1_at, x_at", [(8, 24), (-1, 16), (40, -8)],
                         ids=["both", "h1_skipped", "x_skipped"])
def test_gpu_w13_gluon_out_offsets_and_enable(block_n, warps, h1_at, x_at):
    # h1 and the saved rows at device offsets into one poisoned base (x after h1's range);
    # a negative offset stores nothing there; enable = 0 writes nothing anywhere.
    config = _gluon_tile(block_n, warps)
    _assert_gluon_w13_runs(config)
    case = W13Case(GLUON_COUNTS, hidden=1024, ffn=768, r_cap=GLUON_R_CAP, block_m=128,
                   null_live=[2])
    n, ffn, hidden = case.layout.num_act, 768, 1024
    h1_size, x_size = n * 2 * ffn, n * hidden
    x_off = -1 if x_at < 0 else max(h1_at, 0) + h1_size + x_at
    base = poisoned(max(h1_at, 0) + h1_size + abs(x_at) + x_size + 40)
    offsets = device_int([h1_at, x_off], torch.int64)
    off = poisoned(n + 1, ffn)
    case.run(off, h1_out=base, x_out=base, out_offsets=offsets, config=config,
             enable=device_int([0], torch.int32))
    assert_untouched(off, what="h2 with enable = 0")
    assert_untouched(base, what="base with enable = 0")
    h2 = poisoned(n + 1, ffn)
    case.run(h2, h1_out=base, x_out=base, out_offsets=offsets, config=config,
             enable=device_int([1], torch.int32))
    case.check_rows("h2", h2[:n], tail=h2[n:])
    case.check_saved([("h1", base, h1_at, 2 * ffn), ("x", base, x_off, hidden)])


@pytest.mark.gpu
def test_gpu_w13_gluon_heuristic():
    """On a Hopper GPU with the layer's hint the heuristic picks the Gluon kernel: the
    cooperative tile from 128 rows per expert, else (or
    where F is not a multiple of 128) ping-pong tiles for training and long inference
    segments; short inference segments and widths it cannot tile keep the Triton kernel."""
    if torch.cuda.get_device_capability(DEVICE)[0] != 9:
        pytest.skip("the Gluon W13 is for compute capability 9.x")
    pick = partial(rules.w13_forward_config, device_class=device_class(DEVICE))
    tile = lambda c: (c.gluon, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=2048, training=True)) == \
        (True, 128, 8, 4)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=256)) == (True, 128, 8, 4)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=128, training=True)) == \
        (True, 128, 8, 4)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=128)) == (True, 128, 8, 4)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=64, training=True)) == \
        (True, 64, 4, 6)
    assert tile(pick(hidden=2048, ffn=704, rows_per_expert=2048)) == (True, 64, 4, 5)
    assert not pick(hidden=2048, ffn=768, rows_per_expert=127).gluon
    assert not pick(hidden=4096, ffn=2000, rows_per_expert=2048, training=True).gluon
    assert not rules.w13_forward_config(hidden=4096, ffn=2048, rows_per_expert=2048).gluon


def test_gluon_request_that_cannot_run_warns_and_runs_triton():
    """``W13Config(gluon=True)`` where the Gluon kernel cannot run (here: the interpreter, or
    a tile it is not written for) says why in a RuntimeWarning, then the Triton kernel runs
    the config and is checked against the reference as usual."""
    config = W13Config(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2,
                       gluon=True)
    with pytest.warns(RuntimeWarning, match=r"gather_w13_swiglu: config\.gluon is set, but the "
                                            r"Gluon kernel cannot run this call \(.+\); the "
                                            r"Triton kernel runs the config instead"):
        run_w13_case([5, 0, 16, 21], hidden=64, ffn=48, r_cap=96, config=config, null_live=[7])


def test_gluon_w13_config_reaches_the_launch(monkeypatch):
    """The config's tile reaches the Gluon launch: ``num_warps`` (4 ping-pong, 8
    cooperative), ``block_n``, ``num_stages`` and ``group_m``, into both the shape check and
    the launch. Both 128-column tiles compute the same values, so no GPU test can tell them
    apart; here, on any machine, the launcher is a recorder and the check admits the case."""
    import distmoe.kernels.w13_forward.gluon as wg

    calls = []
    monkeypatch.setattr(wg, "gluon_w13_reason",
                        lambda device, **kw: calls.append(("reason", kw)) and None)
    monkeypatch.setattr(wg, "launch_gluon_w13", lambda *a, **kw: calls.append(("launch", kw)))
    case = W13Case([130, 0, 60], hidden=64, ffn=256, r_cap=3 * 128)
    h2 = poisoned(case.layout.num_act, 256)
    for warps, block_n, stages, group_m in ((8, 128, 4, 8), (4, 64, 6, 16), (4, 128, 3, 8)):
        calls.clear()
        config = replace(GLUON_W13, block_n=block_n, num_warps=warps, num_stages=stages,
                         group_m=group_m)
        case.run(h2, config=config)
        (_, reason), (_, launch) = calls
        assert (reason["block_n"], reason["warps"], reason["stages"]) == (block_n, warps, stages)
        assert (launch["block_n"], launch["warps"], launch["stages"], launch["group_m"]) == (
            block_n, warps, stages, group_m)
        assert launch["lockstep"] is False and launch["expert_groups"] is False
    calls.clear()
    case.run(h2, config=replace(GLUON_W13, lockstep=True))
    assert calls[1][1]["lockstep"] is True
    calls.clear()
    case.run(h2, config=replace(GLUON_W13, expert_groups=True))
    assert calls[1][1]["expert_groups"] is True and calls[1][1]["lockstep"] is False
    assert_untouched(h2, what="h2 (the recorder launched nothing)")


def test_gluon_w13_choice_and_limits_without_a_gpu():
    """What the Hopper heuristic would pick (``distmoe.plan.rules.w13_forward_gluon``, device-independent),
    that no device or a CPU device keeps the Triton kernel, and the shape rules with their
    messages (``shape_reason``), ring sizes included."""
    from distmoe.kernels.w13_forward.gluon import shape_reason, stage_bytes, tile_rows

    pick = rules.w13_forward_gluon
    tile = lambda c: (c.gluon, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    # cooperative 128 x 128 from 128 rows per expert
    for rows, train in ((2048, True), (2048, False), (256, True), (256, False), (128, True),
                        (128, False)):
        assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=rows, training=train)) == \
            (True, 128, 8, 4)
    # its producers in lockstep from 128 rows per expert to 191 (run 52), nowhere else
    lockstep = lambda rows, train, **kw: pick(  # noqa: E731
        hidden=2048, ffn=768, rows_per_expert=rows, training=train, **kw).lockstep
    for train in (True, False):
        assert lockstep(128, train) and lockstep(191, train)
        assert not any(lockstep(rows, train) for rows in (192, 256, 2048))
        assert not lockstep(96, train, num_experts=32)  # ping-pong (training), mid (inference)
    assert not any(lockstep(rows, False) for rows in (1, 63))  # decode
    assert pick(hidden=2880, ffn=2880, rows_per_expert=128, training=True).lockstep
    # the expert-group tile order where the producers run in lockstep (run 58; in training
    # too since run 61), nowhere else
    groups = lambda rows, train, **kw: pick(  # noqa: E731
        hidden=2048, ffn=768, rows_per_expert=rows, training=train, **kw).expert_groups
    for train in (True, False):
        assert groups(128, train) and groups(191, train)
        assert not any(groups(rows, train) for rows in (192, 256, 2048))
        assert pick(hidden=7168, ffn=2048, rows_per_expert=128, training=train).expert_groups
    assert not any(groups(rows, False) for rows in (1, 63))
    assert not groups(96, True, num_experts=32)
    # where 128 does not divide F: cooperative with a partial last column tile while its
    # columns past F are at most F / 16 (2880: 64; 1984: 64), else ping-pong 128 x 64
    # (training, or inference from 1024 rows per expert) or Triton
    for ffn in (2880, 1984):
        for train in (True, False):
            assert tile(pick(hidden=2880, ffn=ffn, rows_per_expert=128, training=train)) == \
                (True, 128, 8, 4)
    long_train = pick(hidden=4096, ffn=960, rows_per_expert=2048, training=True)
    assert tile(long_train) == (True, 64, 4, 5)
    assert tile(pick(hidden=4096, ffn=960, rows_per_expert=2048, training=False)) == \
        (True, 64, 4, 5)
    assert tile(pick(hidden=2048, ffn=704, rows_per_expert=256, training=True)) == \
        (True, 64, 4, 6)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=64, training=True)) == \
        (True, 64, 4, 6)
    # inference below 64 rows per expert (decode): cooperative too
    for rows in (1, 4, 63):
        assert tile(pick(hidden=2048, ffn=768, rows_per_expert=rows, training=False)) == \
            (True, 128, 8, 4)
    # inference at 64-127 rows per expert: cooperative where the local experts are given
    # and their W13 weights total less than 2 GiB (run 38; 128 experts at D=2048 F=2048 are
    # exactly that), else Triton
    for rows, experts, ffn in ((64, 128, 768), (127, 128, 768), (96, 32, 2048),
                               (96, 127, 2048)):
        assert tile(pick(hidden=2048, ffn=ffn, rows_per_expert=rows, training=False,
                         num_experts=experts)) == (True, 128, 8, 4)
    for rows, experts, ffn in ((96, 256, 2048), (96, 128, 2048), (96, None, 768),
                               (127, None, 2048), (128 + 63, 1, 2048)):
        want = None if rows < 128 else (True, 128, 8, 4)
        got = pick(hidden=2048, ffn=ffn, rows_per_expert=rows, training=False,
                   num_experts=experts)
        assert (got if got is None else tile(got)) == want
    # Triton: widths no Gluon tile takes
    assert pick(hidden=2048, ffn=768, rows_per_expert=127, training=False) is None
    assert pick(hidden=4096, ffn=2048, rows_per_expert=64, training=False) is None
    assert pick(hidden=2048, ffn=704, rows_per_expert=16, training=False) is None
    assert pick(hidden=2048, ffn=704, rows_per_expert=256, training=False) is None
    assert pick(hidden=4096, ffn=2000, rows_per_expert=2048, training=True) is None
    assert pick(hidden=4000, ffn=2048, rows_per_expert=2048, training=True) is None
    for device in (None, torch.device("cpu")):
        assert not rules.w13_forward_config(hidden=4096, ffn=2048, rows_per_expert=2048,
                                            training=True, device_class=device_class(device)).gluon
    # the ring: 32 KiB stages with 128 x 64 tiles, 40 KiB with 64 x 128, 48 KiB with the
    # cooperative 128 x 128; at most 200 KiB
    assert (tile_rows(64), tile_rows(128), tile_rows(128, 8)) == (128, 64, 128)
    assert (stage_bytes(64), stage_bytes(128), stage_bytes(128, warps=8)) == (
        32 * 1024, 40 * 1024, 48 * 1024)
    assert replace(long_train, block_n=128, num_warps=8, num_stages=4).smem_bytes() == \
        192 * 1024
    assert long_train.smem_bytes() == 5 * 32 * 1024 and long_train.fits_hopper()
    assert replace(long_train, block_n=128, num_stages=6).smem_bytes() == 240 * 1024
    ok = dict(hidden=4096, ffn=2048, block_m=128, block_k=64)
    assert shape_reason(block_n=64, stages=6, **ok) is None
    assert shape_reason(block_n=128, stages=5, **ok) is None
    assert shape_reason(block_n=128, stages=4, warps=8, **ok) is None
    assert "stages must be one of [3, 4, 5] with block_n = 128 and num_warps = 4, got 6" in \
        shape_reason(block_n=128, stages=6, **ok)
    assert "stages must be one of [3, 4] with block_n = 128 and num_warps = 8, got 5" in \
        shape_reason(block_n=128, stages=5, warps=8, **ok)
    assert "(block_m, block_n, block_k, num_warps) in" in shape_reason(
        hidden=4096, ffn=2048, block_m=128, block_n=32, block_k=64, stages=4)
    assert "got (128, 64, 64, 8)" in shape_reason(block_n=64, stages=4, warps=8, **ok)
    assert "F (2000) must be a multiple of 64" in shape_reason(
        hidden=4096, ffn=2000, block_m=128, block_n=64, block_k=64, stages=4)
