"""Forward expert kernels: W13 gather + SwiGLU, W2 scatter, owner combine.

On CPU the kernels run through Triton's interpreter at small shapes (block_m 16, D/F 32-64);
the ``gpu`` tests repeat them at Hopper tile sizes. Every output is poisoned with NaN before a
run: a row the kernel must write cannot pass the tolerance check while still poisoned, and a
row it must not touch is compared bit-exactly with the poison. Inputs a kernel must not read
(padding rows' pointer-table entries, activation rows beyond ``row_offsets[-1]``, inactive
routes) point at or hold NaN, so reading them shows up in a compared output.

Layouts: padded expert-major rows (``padded_offsets``, the tile schedule and the index of the
pointer tables) with each expert's live rows first, and compact activation rows
(``row_offsets``) for h2 / h1 / x. Expert row counts are mostly not multiples of block_m
(padding present), with empty experts.

Tolerances (``assert_bf16_close``): every kernel computes in fp32 and rounds once to bf16,
compared against an fp64 result from the same bf16 inputs. Copies (saved x, saved h3) and
runs that must not differ (``enable`` = 1 against a plain run) are compared bit-exactly.
"""

from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

ON_INTERPRETER = use_interpreter_if_no_gpu()

import math  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from functools import partial  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.combine import CombineConfig, combine, combine_ref  # noqa: E402
from distmoe.kernels.w2_scatter import W2Config, w2_scatter, w2_scatter_ref  # noqa: E402
from distmoe.kernels.w13_gather_swiglu import (  # noqa: E402
    W13Config,
    gather_w13_swiglu,
    gather_w13_swiglu_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Small tiles for the interpreter: block_m 16 is the padding multiple of these tests.
BM = 16
W13_SMALL = W13Config(block_m=BM, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)
W2_SMALL = W2Config(block_m=BM, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, *, what: str) -> None:
    """bf16 kernel output against an fp64 expectation.

    Relative 2^-7: bf16 keeps 8 significant bits, so rounding the fp32 result moves it by at
    most 2^-8 relative; the second half-ulp of slack covers the fp32 result differing from
    fp64 in its last bits right at a rounding boundary. Absolute 1e-3 of the largest
    magnitude: for elements that cancel to near zero, fp32 accumulation-order error (about
    n * 2^-24 * sum|terms|, n <= 1024 here) dominates; 1e-3 is far above it and far below
    any indexing mistake (wrong row, expert or column: O(1) relative error).
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    got = actual.double().cpu()
    want = expected.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN (poison left or produced)"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs()
    bad = err > _bf16_bound(want, scale)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance, "
        f"max err {err.max().item():.3g} (scale {scale:.3g})"
    )


def _bf16_bound(want: torch.Tensor, scale) -> torch.Tensor:
    """:func:`assert_bf16_close`'s bound on ``|got - want|`` (``scale``: the magnitude the
    absolute part is relative to)."""
    return 2**-7 * want.abs() + 1e-3 * scale


def _assert_rows_bf16_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """:func:`assert_bf16_close` on every row of ``got`` / ``want`` (fp64, CPU), each row
    with its own scale, found at once; the first bad row fails there, named by
    ``what(row)``."""
    scale = want.abs().amax(dim=1, keepdim=True)
    bad = torch.isnan(got).any(dim=1) | ((got - want).abs() > _bf16_bound(want, scale)).any(1)
    if bad.any():
        k = int(bad.nonzero()[0])
        assert_bf16_close(got[k], want[k], what=what(k))


def poisoned(*shape: int) -> torch.Tensor:
    """bf16 NaN-filled output buffer."""
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)


def assert_untouched(tensor: torch.Tensor, *, what: str) -> None:
    """Every element still holds the NaN poison, bit for bit."""
    poison = torch.full_like(tensor, float("nan")).view(torch.int16)
    assert torch.equal(tensor.view(torch.int16), poison), f"{what}: written, must be untouched"


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, *, what: str) -> None:
    """Bit-exact equality of bf16 tensors (NaN poison included)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16)), f"{what}: differs"


def addr(tensor: torch.Tensor, row: int, row_elems: int) -> int:
    """Absolute byte address of ``row`` of a contiguous bf16 tensor seen as rows."""
    return tensor.data_ptr() + row * row_elems * tensor.element_size()


def device_int(values, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


@dataclass
class Layout:
    """Padded expert-major rows (tile schedule) and compact activation rows of one call.

    ``padded[e]``/``act[e]``: host copies of ``padded_offsets``/``row_offsets``; ``live[e]``:
    the padded rows of expert ``e``'s live rows (the first ``n_e`` of its segment);
    ``padding``: the padded rows of the segments beyond their live rows.
    """

    padded_offsets: torch.Tensor
    row_offsets: torch.Tensor
    padded: list[int]
    act: list[int]
    live: list[list[int]]
    padding: list[int]

    @property
    def num_act(self) -> int:
        return self.act[-1]

    def expert_of_act(self) -> list[int]:
        return [e for e in range(len(self.live)) for _ in self.live[e]]


def build_layout(counts, *, r_cap, block_m=BM, min_rows=None) -> Layout:
    """Each expert's segment is ``ceil(n / block_m) * block_m`` rows (at least ``min_rows[e]``:
    a routing layer may pad an empty expert to a whole tile of padding); its ``n`` live rows
    come first. Activation rows are the exclusive prefix sum of the counts."""
    padded, act, live, padding = [0], [0], [], []
    for e, n in enumerate(counts):
        seg = math.ceil(n / block_m) * block_m
        if min_rows is not None:
            seg = max(seg, min_rows[e])
        start = padded[-1]
        live.append(list(range(start, start + n)))
        padding.extend(range(start + n, start + seg))
        padded.append(start + seg)
        act.append(act[-1] + n)
    assert padded[-1] <= r_cap, "test layout exceeds R_cap"
    return Layout(
        padded_offsets=device_int(padded, torch.int32),
        row_offsets=device_int(act, torch.int32),
        padded=padded,
        act=act,
        live=live,
        padding=padding,
    )


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


def random_weights(num_experts, hidden, ffn):
    # Scaled so that g, u and h3 stay O(1).
    w13 = torch.randn(num_experts, 2, ffn, hidden, device=DEVICE) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, ffn, device=DEVICE) / math.sqrt(ffn)
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


GRIDS = pytest.mark.parametrize(
    "persistent, host_descriptors",
    [(False, True), (True, True), (False, False), (True, False)],
    ids=["tile_grid", "persistent", "tile_grid-device_desc", "persistent-device_desc"],
)
PERSISTENT = pytest.mark.parametrize("persistent", [False, True], ids=["tile_grid", "persistent"])


# --------------------------------------------------------------------------------------------
# W13 gather + SwiGLU
# --------------------------------------------------------------------------------------------


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


META_I32 = torch.zeros(3, dtype=torch.int32, device="meta")


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


# --------------------------------------------------------------------------------------------
# W2 scatter
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Combine
# --------------------------------------------------------------------------------------------


# bf16 bits of a NaN whose payload differs from torch's NaN (0x7FC0): the h3 save base is
# filled with it, so a copied NaN row (an inactive route's) cannot pass for untouched.
def run_combine_case(num_tokens, max_tokens, top_k, hidden, *, id_dtype, score_dtype, config, use_ref=False, three_d=False):  # fmt: skip
    expert_ids = torch.randint(0, 5, (num_tokens, top_k))
    expert_ids[torch.rand(num_tokens, top_k) < 0.3] = -1
    if num_tokens > 2:
        expert_ids[2] = -1  # one token with every route inactive
    scores = torch.rand(num_tokens, top_k)
    is_active = expert_ids >= 0
    rows = torch.randn(max_tokens * top_k, hidden).to(torch.bfloat16)
    # Inactive routes and rows beyond T*K hold NaN: they must never be read.
    rows[: num_tokens * top_k][~is_active.reshape(-1)] = float("nan")
    rows[num_tokens * top_k :] = float("nan")
    scores[~is_active] = float("nan")
    scores = scores.to(score_dtype)

    expected = (
        torch.where(is_active, scores.double(), 0.0)[..., None]
        * torch.where(is_active[..., None], rows[: num_tokens * top_k].double().reshape(num_tokens, top_k, hidden), 0.0)
    ).sum(dim=1)  # fmt: skip

    rows_arg = rows.reshape(max_tokens, top_k, hidden) if three_d else rows
    y = poisoned(num_tokens, hidden)
    args = (rows_arg.to(DEVICE), expert_ids.to(id_dtype).to(DEVICE), scores.to(DEVICE), y)
    if use_ref:
        combine_ref(*args)
    else:
        combine(*args, config=config)
    assert_bf16_close(y, expected, what="y")
    none_active = ~is_active.any(dim=1)
    # Tokens with no active route are exact zeros.
    assert torch.equal(
        y[none_active.to(DEVICE)].float().cpu(), torch.zeros(int(none_active.sum()), hidden)
    )


COMBINE_SMALL = CombineConfig(block_t=4, block_d=32, num_warps=4)


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.int16, torch.int8])
@pytest.mark.parametrize("score_dtype", [torch.float32, torch.bfloat16])
def test_combine(id_dtype, score_dtype):
    # T=13 (not a multiple of block_t=4) of T_max=16, K=3, D=48 (not a multiple of block_d=32).
    run_combine_case(
        13, 16, 3, 48, id_dtype=id_dtype, score_dtype=score_dtype, config=COMBINE_SMALL
    )


def test_combine_top1_three_d_rows_default_config():
    # K=1, combine_rows given as [T_max, K, D], heuristic config.
    run_combine_case(7, 8, 1, 40, id_dtype=torch.int64, score_dtype=torch.float32, config=None, three_d=True)  # fmt: skip


def test_combine_no_tokens():
    # T=0: nothing to do, nothing touched.
    y = poisoned(0, 32)
    rows = torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    combine(rows, ids, torch.zeros(0, 2, device=DEVICE), y)
    assert y.shape == (0, 32)


@pytest.mark.parametrize("hidden", [48, 20], ids=["D48", "D20"])
def test_combine_rows_addr(hidden):
    """Rows read at a device-side address (a saved layer's h3 rows in its slot): bit-exact
    equal to reading the same rows as a tensor, and the rows are only read."""
    num_tokens, max_tokens, top_k = 13, 16, 3
    ids = torch.randint(0, 5, (num_tokens, top_k))
    ids[torch.rand(num_tokens, top_k) < 0.3] = -1
    ids = ids.to(DEVICE)
    scores = torch.rand(num_tokens, top_k, device=DEVICE)
    lead = 5  # route row 0 sits 5 rows into a larger buffer
    buffer = torch.randn(lead + max_tokens * top_k + 2, hidden, device=DEVICE).bfloat16()
    buffer[lead:][:num_tokens * top_k][(ids < 0).reshape(-1)] = float("nan")  # never read
    before = buffer.clone()
    want = combine(buffer[lead:lead + max_tokens * top_k].clone(), ids, scores,
                   poisoned(num_tokens, hidden), config=COMBINE_SMALL)
    addr = torch.tensor([buffer[lead].data_ptr()], dtype=torch.int64, device=DEVICE)
    got = combine(None, ids, scores, poisoned(num_tokens, hidden), rows_addr=addr,
                  config=COMBINE_SMALL)
    assert_bits_equal(got, want, what="y from rows_addr")
    assert_bits_equal(buffer, before, what="rows behind rows_addr")
    with pytest.raises(ValueError, match="combine_rows must be None when rows_addr is given"):
        combine(buffer, ids, scores, got, rows_addr=addr)
    with pytest.raises(TypeError, match="combine_rows must be a torch.Tensor unless rows_addr"):
        combine(None, ids, scores, got)
    with pytest.raises(TypeError, match="rows_addr"):
        combine(None, ids, scores, got, rows_addr=addr.int())

def test_combine_reference():
    run_combine_case(13, 16, 3, 48, id_dtype=torch.int16, score_dtype=torch.float32, config=None, use_ref=True)  # fmt: skip


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(expert_ids=a["expert_ids"].float()), TypeError, "expert_ids must have dtype"),
        (lambda a: a.update(scores=a["scores"][:, :1]), ValueError, r"scores must have shape \[5, 2\]"),
        (lambda a: a.update(scores=a["scores"].double()), TypeError, "scores must have dtype"),
        (lambda a: a.update(y_out=a["y_out"][:4]), ValueError, r"y_out must have T=5 rows"),
        (lambda a: a.update(combine_rows=a["combine_rows"][:8]), ValueError, r"T_max >= T=5"),
        (lambda a: a.update(combine_rows=a["combine_rows"][:, :8].contiguous()), ValueError, "combine_rows must have shape"),
        (lambda a: a.update(combine_rows=a["combine_rows"].t().contiguous().t()), ValueError, "combine_rows must be contiguous"),
        (lambda a: a.update(expert_ids=a["expert_ids"].t()), ValueError, "expert_ids must be contiguous"),
        (lambda a: a.update(y_out=a["y_out"].to("meta")), ValueError, r"y_out must be on the same device as combine_rows \((cpu|cuda:\d+)\), got meta"),
    ],
)  # fmt: skip
def test_combine_rejects_bad_inputs(change, error, match):
    args = dict(
        combine_rows=torch.zeros(12, 16, dtype=torch.bfloat16, device=DEVICE),
        expert_ids=torch.zeros(5, 2, dtype=torch.int64, device=DEVICE),
        scores=torch.zeros(5, 2, device=DEVICE),
        y_out=poisoned(5, 16),
    )
    change(args)
    with pytest.raises(error, match=match):
        combine(**args)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def test_configs():
    w13 = W13Config.from_heuristic(hidden=4096, ffn=2048)
    assert (w13.block_m, w13.block_n, w13.block_k, w13.num_warps) == (128, 128, 64, 8)
    assert 3 <= w13.num_stages <= 4 and w13.fits_hopper()
    w2 = W2Config.from_heuristic(hidden=4096, ffn=2048)
    assert (w2.block_m, w2.block_n, w2.block_k, w2.num_warps) == (128, 128, 64, 8)
    assert w2.fits_hopper()
    assert w13.host_descriptors and w2.host_descriptors and not (w13.persistent or w2.persistent)
    assert not w13.tma_epilogue
    # With the shape hint: persistent; 4 stages but for training with long expert segments
    # (hint >= 1024); the TMA epilogue only for inference with long segments.
    for hint, training, stages, tma in ((2048, False, 4, True), (2048, True, 3, False),
                                        (256, False, 4, False), (256, True, 4, False)):
        c = W13Config.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=hint,
                                     training=training)
        assert (c.persistent, c.num_stages, c.tma_epilogue) == (True, stages, tma)
        assert c.fits_hopper()
    with pytest.raises(TypeError, match="tma_epilogue must be a bool"):
        W13Config(tma_epilogue=1)
    for cls in (W13Config, W2Config):
        configs = cls.all_configs(block_m=128)
        assert configs and all(c.fits_hopper() and c.block_m == 128 for c in configs)
    assert CombineConfig.all_configs()
    # the combine: one token of 1024 columns, 8 warps (run 33); small D: 1024 elements
    assert CombineConfig.from_heuristic(hidden=2048) == CombineConfig(block_t=1, block_d=1024,
                                                                      num_warps=8)
    assert CombineConfig.from_heuristic(hidden=7168).block_d == 1024
    assert CombineConfig.from_heuristic(hidden=48) == CombineConfig(block_t=16, block_d=64,
                                                                    num_warps=4)
    with pytest.raises(ValueError, match=r"block_k \(48\) must be a power of two"):
        W13Config(block_k=48)
    with pytest.raises(ValueError, match=r"num_warps \(2\) must be 4 or 8"):
        W2Config(num_warps=2)
    with pytest.raises(TypeError):
        W2Config(128)  # keyword-only


# --------------------------------------------------------------------------------------------
# Whole forward on one rank: gather + W13 + SwiGLU -> W2 scatter -> combine
# --------------------------------------------------------------------------------------------


def run_forward_chain(num_tokens, top_k, num_experts, hidden, ffn, *, block_m, w13_config=None, w2_config=None):  # fmt: skip
    """Route, run the three kernels, and compare with an fp64 MoE of the same bf16 inputs.

    The chain rounds to bf16 three times (h2, h3, y), each a relative error of at most 2^-8,
    so per element (first order, fp32 accumulation error negligible beside it):
        |y - y64| <= 2^-8 |y64| + sum_k s_k 2^-8 (|h3_k| + |h2_k| @ |w2_e|^T)
    The test allows twice that (2^-7: a correctly rounded value may sit half an ulp off the
    fp32 result, which itself differs from fp64), plus 1e-4 of the output scale for
    accumulation-order noise in elements that cancel to near zero.
    """
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(torch.bfloat16)
    expert_ids = torch.randint(0, num_experts, (num_tokens, top_k), device=DEVICE)
    expert_ids[torch.rand(num_tokens, top_k, device=DEVICE) < 0.2] = -1
    scores = torch.rand(num_tokens, top_k, device=DEVICE)
    scores = torch.where(expert_ids >= 0, scores, 0.0)
    w13, w2 = random_weights(num_experts, hidden, ffn)

    # Routing tables (host-side here; the routing layer builds them on the device): live rows
    # first in each padded segment, compact activation rows.
    ids = expert_ids.cpu()
    counts = [int((ids == e).sum()) for e in range(num_experts)]
    offsets, act = [0], [0]
    for n in counts:
        offsets.append(offsets[-1] + math.ceil(n / block_m) * block_m)
        act.append(act[-1] + n)
    r_cap = math.ceil(num_tokens * top_k / block_m) * block_m + num_experts * block_m
    combine_rows = poisoned(num_tokens * top_k, hidden)
    gather_ptrs = torch.zeros(r_cap, dtype=torch.int64)
    scatter_ptrs = torch.zeros(r_cap, dtype=torch.int64)
    fill = list(offsets[:-1])
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e < 0:
                continue
            gather_ptrs[fill[e]] = addr(x, t, hidden)
            scatter_ptrs[fill[e]] = addr(combine_rows, t * top_k + k, hidden)
            fill[e] += 1
    padded_offsets = device_int(offsets, torch.int32)
    row_offsets = device_int(act, torch.int32)
    gather_ptrs, scatter_ptrs = gather_ptrs.to(DEVICE), scatter_ptrs.to(DEVICE)

    h2 = poisoned(max(1, act[-1]), ffn)  # activation rows only
    gather_w13_swiglu(
        gather_ptrs, padded_offsets, row_offsets, w13, h2, config=w13_config, block_m=block_m
    )
    w2_scatter(h2, padded_offsets, row_offsets, w2, scatter_ptrs, config=w2_config, block_m=block_m)
    y = combine(combine_rows, expert_ids, scores, poisoned(num_tokens, hidden))

    # fp64 layer and the first-order bound of the three bf16 roundings.
    y64 = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    routed_mag = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    x64, w13_64, w2_64 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e < 0:
                continue
            g = x64[t] @ w13_64[e, 0].T
            u = x64[t] @ w13_64[e, 1].T
            h2_64 = torch.nn.functional.silu(g) * u
            h3_64 = h2_64 @ w2_64[e].T
            s = float(scores[t, k])
            y64[t] += s * h3_64
            routed_mag[t] += s * (h3_64.abs() + h2_64.abs() @ w2_64[e].abs().T)
    bound = 2**-7 * (y64.abs() + routed_mag) + 1e-4 * y64.abs().max()
    err = (y.double().cpu() - y64).abs()
    assert not torch.isnan(y).any()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} elements out of the rounding bound, max err {err.max().item():.3g}"
    )
    none_active = (ids < 0).all(dim=1)
    assert torch.equal(y[none_active.to(DEVICE)].float().cpu(), torch.zeros(int(none_active.sum()), hidden))  # fmt: skip


def test_forward_chain_one_rank():
    # 11 tokens (odd, less than a row block per expert on average), K=2, 5 experts (prime).
    run_forward_chain(11, 2, 5, 32, 48, block_m=BM, w13_config=W13_SMALL, w2_config=W2_SMALL)


# --------------------------------------------------------------------------------------------
# GPU: Hopper tile sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@GRIDS
def test_gpu_w13_hopper_tiles(persistent, host_descriptors):
    # Default 128x128x64 tiles, F=768 (6 column tiles), skewed experts incl. an empty one.
    config = W13Config.from_heuristic(hidden=1024, ffn=768)
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
# Hopper-sized case: 12 (or 6) column tiles, 16 K steps; full tiles (128, 1000 = 7 + a
# partial one, 128), partial ones, an empty expert, a one-row expert, a live row with a null
# address.
GLUON_COUNTS = [300, 0, 128, 1000, 1, 64, 128, 511]
GLUON_R_CAP = sum(math.ceil(n / 128) * 128 for n in GLUON_COUNTS) + 3 * 128
# the three tiles: ping-pong 128 x 64 and 64 x 128 h2, cooperative 128 x 128 (num_warps 8)
GLUON_TILES = pytest.mark.parametrize("block_n, warps", [(64, 4), (128, 4), (128, 8)],
                                      ids=["128x64", "64x128", "128x128coop"])


def _gluon_tile(block_n, warps):
    """GLUON_W13 with the tile of GLUON_TILES (the cooperative one takes at most 4 stages)."""
    return replace(GLUON_W13, block_n=block_n, num_warps=warps,
                   num_stages=4 if warps == 8 else GLUON_W13.num_stages)


def _assert_gluon_w13_runs(config, *, hidden=1024, ffn=768):
    from distmoe.kernels.w13_gluon import gluon_w13_reason

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
    from distmoe.kernels.w13_gluon import launch_gluon_w13

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
    from distmoe.kernels._common import num_sms

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
    pick = partial(W13Config.from_heuristic, device=DEVICE)
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
    assert not W13Config.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048).gluon


@pytest.mark.gpu
@GRIDS
def test_gpu_w2_scatter_hopper_tiles(persistent, host_descriptors):
    # Default tiles, an empty expert padded to a whole null tile, two idle tiles.
    config = W2Config.from_heuristic(hidden=1024, ffn=768)
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
    from distmoe.kernels.w2_gluon import gluon_w2_reason

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
    pick = partial(W2Config.from_heuristic, device=DEVICE)
    tile = lambda c: (c.gluon, c.block_n, c.num_warps, c.num_stages)  # noqa: E731
    assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=2048)) == (True, 128, 4, 6)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=256)) == (True, 128, 4, 6)
    assert tile(pick(hidden=2048, ffn=768, rows_per_expert=128)) == (True, 128, 4, 6)
    assert not pick(hidden=2048, ffn=768, rows_per_expert=127).gluon
    assert tile(pick(hidden=4096, ffn=2048, rows_per_expert=2048, ep_size=2)) == \
        (True, 128, 4, 6)
    assert tile(pick(hidden=2880, ffn=2880, rows_per_expert=2048)) == (True, 128, 4, 6)
    assert not pick(hidden=2912, ffn=2880, rows_per_expert=2048).gluon
    assert not W2Config.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048).gluon


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
    from distmoe.kernels.w2_gluon import launch_gluon_w2

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
    from distmoe.kernels._common import num_sms

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


@pytest.mark.gpu
def test_gpu_forward_chain():
    run_forward_chain(256, 4, 8, 512, 384, block_m=128)


@pytest.mark.gpu
def test_gpu_combine_large():
    run_combine_case(1000, 1024, 8, 4096, id_dtype=torch.int16, score_dtype=torch.float32, config=None)  # fmt: skip


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_routing():
    # Capture W13 and W2 once; new routing tables and a new enable flag written in place
    # replay correctly (grids depend on R_cap only, counts and the flag are read on the
    # device); unaddressed rows stay untouched; enable = 0 writes nothing.
    hidden, ffn, num_experts, r_cap, r_act = 256, 256, 4, 1024, 600
    w13, w2 = random_weights(num_experts, hidden, ffn)
    x = torch.randn(64, hidden, device=DEVICE).to(torch.bfloat16)
    gather_ptrs = torch.zeros(r_cap, dtype=torch.int64, device=DEVICE)
    scatter_ptrs = torch.zeros(r_cap, dtype=torch.int64, device=DEVICE)
    padded_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE)
    row_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE)
    enable = torch.ones(1, dtype=torch.int32, device=DEVICE)
    h2 = torch.zeros(r_act, ffn, dtype=torch.bfloat16, device=DEVICE)
    out = torch.zeros(r_cap, hidden, dtype=torch.bfloat16, device=DEVICE)

    def forward():
        gather_w13_swiglu(gather_ptrs, padded_offsets, row_offsets, w13, h2, enable=enable)
        w2_scatter(h2, padded_offsets, row_offsets, w2, scatter_ptrs, enable=enable)

    forward()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for counts, flag in (([64, 0, 200, 3], 1), ([0, 500, 1, 0], 1), ([7, 9, 0, 130], 0)):
        offsets, act = [0], [0]
        for n in counts:
            offsets.append(offsets[-1] + math.ceil(n / 128) * 128)
            act.append(act[-1] + n)
        g = torch.zeros(r_cap, dtype=torch.int64)
        s = torch.zeros(r_cap, dtype=torch.int64)
        src_rows = torch.zeros(r_cap, dtype=torch.int64)
        for e, n in enumerate(counts):
            for i in range(n):
                r = offsets[e] + i
                src_rows[r] = int(torch.randint(64, ()))
                g[r] = addr(x, int(src_rows[r]), hidden)
                s[r] = addr(out, r, hidden)
        gather_ptrs.copy_(g)
        scatter_ptrs.copy_(s)
        padded_offsets.copy_(torch.tensor(offsets, dtype=torch.int32))
        row_offsets.copy_(torch.tensor(act, dtype=torch.int32))
        enable.fill_(flag)
        out.fill_(float("nan"))
        h2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if not flag:
            assert_untouched(out, what="out with enable=0")
            assert_untouched(h2, what="h2 with enable=0")
            continue
        assert_untouched(h2[act[-1] :], what="h2 beyond row_offsets[-1]")
        is_live = torch.zeros(r_cap, dtype=torch.bool)
        for e, n in enumerate(counts):
            is_live[offsets[e] : offsets[e] + n] = True
        assert_untouched(out[(~is_live).to(DEVICE)], what="rows no live row points at")
        for e, n in enumerate(counts):
            if n == 0:  # an empty expert has no rows to check (its idle rows are checked above)
                continue
            rows = slice(offsets[e], offsets[e] + n)
            xe = x[src_rows[rows].to(DEVICE)].double()
            h2_64 = torch.nn.functional.silu(xe @ w13[e, 0].double().T) * (
                xe @ w13[e, 1].double().T
            )
            w2_64 = w2[e].double()
            h3_64 = h2_64 @ w2_64.T
            # Two bf16 roundings (h2, h3): first-order bound as in run_forward_chain.
            bound = 2**-7 * (h3_64.abs() + h2_64.abs() @ w2_64.abs().T) + 1e-4 * h3_64.abs().max()
            err = (out[rows].double() - h3_64).abs()
            assert not torch.isnan(out[rows]).any() and bool((err <= bound).all()), (
                f"replay with counts {counts}: expert {e} max err {err.max().item():.3g}"
            )


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


def test_every_bool_option_of_the_gemm_configs_is_checked():
    """GemmConfig checks every field annotated ``bool``, a subclass's too (the four launch
    configs declare theirs only): an int there is a TypeError naming the field and the type.
    The options each config has are listed, so a new one cannot go unchecked unnoticed."""
    import dataclasses

    from distmoe.kernels.w2_backward import W2DgradConfig
    from distmoe.kernels.w13_backward import W13DgradConfig

    common = ["persistent", "host_descriptors"]
    expected = {W13Config: common + ["tma_epilogue", "gluon", "lockstep", "expert_groups"],
                W2Config: common + ["gluon", "lockstep", "expert_groups"],
                W2DgradConfig: common + ["gluon", "epilogue_early_h1", "lockstep",
                                         "expert_groups"],
                W13DgradConfig: common + ["pair_tails", "dynamic", "gluon", "lockstep",
                                          "expert_groups"]}
    for cls, names in expected.items():
        assert [f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)] == names
        for name in names:
            with pytest.raises(TypeError, match=f"^{name} must be a bool, got int$"):
                cls(**{name: 1})


def test_gluon_w13_config_reaches_the_launch(monkeypatch):
    """The config's tile reaches the Gluon launch: ``num_warps`` (4 ping-pong, 8
    cooperative), ``block_n``, ``num_stages`` and ``group_m``, into both the shape check and
    the launch. Both 128-column tiles compute the same values, so no GPU test can tell them
    apart; here, on any machine, the launcher is a recorder and the check admits the case."""
    import distmoe.kernels.w13_gluon as wg

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


def test_gluon_w2_config_reaches_the_launch(monkeypatch):
    """The W2 config's tile reaches the Gluon launch (``num_warps``, ``block_n``,
    ``num_stages``, ``group_m``) and the enable flag with it, on any machine: the launcher is
    a recorder and the check admits the case. ``gluon=False`` never calls either."""
    import distmoe.kernels.w2_gluon as wg

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


def test_w2_heuristic_takes_gluon_at_every_ep_size(monkeypatch):
    """``W2Config.from_heuristic`` on a device where Gluon runs (stood in for by the device
    check returning ``None``): the Gluon tile from 128 rows per expert at EP=1 and EP=2 (run
    29, interleaved: faster at both), the Triton kernel's config below 128 rows and with no
    device."""
    # imported before the patch: a first import under it would bind the stand-in into
    # w2_gluon's namespace for the rest of the process
    import distmoe.kernels.w2_gluon  # noqa: F401
    import distmoe.kernels.wgrad_gluon as wgg

    monkeypatch.setattr(wgg, "gluon_device_reason", lambda device: None)
    pick = partial(W2Config.from_heuristic, hidden=4096, ffn=2048, device=DEVICE)
    gluon_cfg = W2Config.hopper_gluon(hidden=4096, ffn=2048, rows_per_expert=2048)
    assert gluon_cfg.gluon
    for ep in (1, 2, 4):
        assert pick(rows_per_expert=2048, ep_size=ep) == gluon_cfg
    triton_cfg = W2Config.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048)
    assert not triton_cfg.gluon
    assert pick(rows_per_expert=127) == W2Config.from_heuristic(hidden=4096, ffn=2048,
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
    from distmoe.kernels.w2_gluon import gluon_w2_reason, shape_reason, stage_bytes

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
        assert tile(W2Config.hopper_gluon(hidden=4096, ffn=2048, rows_per_expert=rows)) == \
            (True, 128, 4, 6)
    assert W2Config.hopper_gluon(hidden=4096, ffn=2048, rows_per_expert=127) is None
    assert W2Config.hopper_gluon(hidden=2048, ffn=768, rows_per_expert=96) is None
    # its producers in lockstep at 128-191 rows per expert where an expert's W2 weights hold
    # at least 8 MiB (run 52): D=4096 F=1024 is exactly that, D=2048 F=768 (3 MiB) not
    lockstep = lambda rows, hidden=4096, ffn=1024: W2Config.hopper_gluon(  # noqa: E731
        hidden=hidden, ffn=ffn, rows_per_expert=rows).lockstep
    assert lockstep(128) and lockstep(191) and lockstep(128, 2880, 2880)
    assert not any(lockstep(rows) for rows in (192, 256, 2048))
    assert not lockstep(128, 4096, 960) and not lockstep(128, 2048, 768)
    assert not W2Config.hopper_gluon(hidden=4096, ffn=1024, rows_per_expert=96,
                                     num_experts=32).lockstep  # mid rows
    # the expert-group tile order at EP=1 from 128 to 1024 rows per expert (run 59: the
    # forward 1.010-1.041x there, 0.967x at 2048; run 60: in training too)
    groups = lambda rows, **kw: W2Config.hopper_gluon(  # noqa: E731
        hidden=4096, ffn=2048, rows_per_expert=rows, **kw).expert_groups
    assert groups(128) and groups(512) and groups(1024)
    assert not any(groups(rows) for rows in (1025, 2048))
    assert not groups(96, num_experts=32)  # mid rows: not measured
    assert not any(groups(rows, ep_size=2) for rows in (128, 512, 1024))
    # 64-127 rows per expert: Gluon where the local experts are given and their W2 weights
    # total less than 2 GiB (run 38; 128 experts at D=4096 F=2048 are exactly that); below
    # 64 Triton whatever the count
    for rows, experts, hidden in ((64, 128, 2048), (127, 64, 2048), (96, 127, 4096)):
        assert tile(W2Config.hopper_gluon(hidden=hidden, ffn=2048, rows_per_expert=rows,
                                          num_experts=experts)) == (True, 128, 4, 6)
    for rows, experts, hidden in ((96, 256, 4096), (96, 128, 4096), (96, 128, 7168),
                                  (63, 8, 2048), (96, None, 2048)):
        assert W2Config.hopper_gluon(hidden=hidden, ffn=2048, rows_per_expert=rows,
                                     num_experts=experts) is None
    assert tile(W2Config.hopper_gluon(hidden=4096, ffn=2048, rows_per_expert=2048,
                                      ep_size=2)) == (True, 128, 4, 6)
    # D = 2880 (GPT-OSS): each row's last column tile partial
    assert tile(W2Config.hopper_gluon(hidden=2880, ffn=2880, rows_per_expert=2048)) == \
        (True, 128, 4, 6)
    assert W2Config.hopper_gluon(hidden=2912, ffn=2880, rows_per_expert=2048) is None
    # at 64-127 rows per expert only where 128 divides D (run 49: 0.8-0.9% slower at 2880)
    assert W2Config.hopper_gluon(hidden=2880, ffn=2880, rows_per_expert=64,
                                 num_experts=32) is None
    assert tile(W2Config.hopper_gluon(hidden=2944, ffn=2880, rows_per_expert=128,
                                      num_experts=32)) == (True, 128, 4, 6)
    assert W2Config.hopper_gluon(hidden=2048, ffn=200, rows_per_expert=2048) is None
    for device in (None, torch.device("cpu")):
        assert not W2Config.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048,
                                           device=device).gluon
    if DEVICE.type == "cpu":
        case = W2Case([5, 0, 21], hidden=128, ffn=64, r_cap=3 * 128, block_m=128)
        with pytest.warns(RuntimeWarning, match="w2_scatter: config.gluon is set"):
            case.run(config=GLUON_W2)
        case.check()


def test_gluon_w13_choice_and_limits_without_a_gpu():
    """What the Hopper heuristic would pick (``W13Config.hopper_gluon``, device-independent),
    that no device or a CPU device keeps the Triton kernel, and the shape rules with their
    messages (``shape_reason``), ring sizes included."""
    from distmoe.kernels.w13_gluon import shape_reason, stage_bytes, tile_rows

    pick = W13Config.hopper_gluon
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
        assert not W13Config.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048,
                                            training=True, device=device).gluon
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
