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

Shared by the forward kernel tests (``w13_forward/``, ``w2_forward/``, ``movement/test_combine.py``, ``test_forward_chain.py``, ``test_forward_configs.py``): the layouts, cases and checks above.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from distmoe.kernels.w2_forward.config import W2Config
from distmoe.kernels.w13_forward.config import W13Config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Small tiles for the interpreter: block_m 16 is the padding multiple of these tests.
BM = 16


W13_SMALL = W13Config(block_m=BM, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)


W2_SMALL = W2Config(block_m=BM, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)


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
    bad = err > bf16_bound(want, scale)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance, "
        f"max err {err.max().item():.3g} (scale {scale:.3g})"
    )


def bf16_bound(want: torch.Tensor, scale) -> torch.Tensor:
    """:func:`assert_bf16_close`'s bound on ``|got - want|`` (``scale``: the magnitude the
    absolute part is relative to)."""
    return 2**-7 * want.abs() + 1e-3 * scale


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


META_I32 = torch.zeros(3, dtype=torch.int32, device="meta")


# Hopper-sized case: 12 (or 6) column tiles, 16 K steps; full tiles (128, 1000 = 7 + a
# partial one, 128), partial ones, an empty expert, a one-row expert, a live row with a null
# address.
GLUON_COUNTS = [300, 0, 128, 1000, 1, 64, 128, 511]


GLUON_R_CAP = sum(math.ceil(n / 128) * 128 for n in GLUON_COUNTS) + 3 * 128
