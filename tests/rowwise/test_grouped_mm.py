"""``distmoe.rowwise.grouped_mm`` (bf16) on the CPU through Triton's interpreter, and on one
GPU against torch._grouped_mm.

Forward tolerance (against torch._grouped_mm, which runs on the CPU in torch 2.13 and, like
the kernel, sums the exact bf16 x bf16 products in fp32 and rounds once): the two fp32 sums
differ only by summation order, at most ``2 K 2^-24 sum_k |a_k b_k|``; after one rounding
each, at most that plus one bf16 ulp of the result. Rows past ``offs[-1]`` are compared with
exact zeros (torch leaves them uninitialised: ``torch.empty``).

Gradient rule (the project's, tests/ops/test_training.py): our max abs error against torch
autograd of the per-expert reference :func:`grouped_mm_ref` on fp64 copies of the same bf16
inputs is at most 2x the error of torch's bf16 autograd of that reference against the fp64
oracle, plus a floor of 1/128 (two bf16 ulps) of the largest fp64 gradient magnitude. Rows of
no group get exact zeros in ``grad_a``, an empty group exact zeros in ``grad_b``.
"""

import pytest
import torch

import distmoe
from distmoe.kernels.grouped import GroupedConfig, num_row_tiles
from distmoe.kernels.scaled.triton import FP8_BLOCK, MXFP8, MXFP8_REBASED, scaled_grouped_mm
from distmoe.quant import (
    fp8_block_quantize,
    fp8_block_quantize_weight,
    mxfp8_quantize,
    mxfp8_quantize_weight,
    mxfp8_rebase,
)
from distmoe.rowwise import grouped_mm
from distmoe.rowwise.grouped import grouped_mm_ref

# small tiles: groups span several row tiles, tiles end inside groups, 2 column tiles
SMALL = GroupedConfig(block_m=16, block_n=16, block_k=16, num_warps=4, group_m=2)

# (group sizes, M): offs = cumsum(sizes), M >= sum
CASES = {
    "balanced": ([16, 16, 16], 48),  # whole tiles only
    "empty_groups": ([0, 13, 0, 20, 0], 33),  # empty first, middle and last groups
    "tail_rows": ([5, 17, 3], 40),  # partial tiles and 15 rows of no group
    "one_group_all": ([0, 0, 37, 0], 37),  # every row to one expert
    "single_expert": ([23], 29),  # E = 1, rows past its end
    "prime_e_odd": ([3, 1, 4, 1, 5, 9, 2], 31),  # prime E = 7, odd group sizes
    "no_live_rows": ([0, 0, 0], 9),  # offs all 0: the whole result is zeros
}


def _problem(sizes, num_rows, k=24, n=40, transposed=False):
    a = torch.randn(num_rows, k).bfloat16()
    if transposed:  # weights stored [E, N, K], passed as a transposed view
        b = torch.randn(len(sizes), n, k).bfloat16().transpose(1, 2)
    else:
        b = torch.randn(len(sizes), k, n).bfloat16()
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return a, b, offs


def _ulp(x):
    """One bf16 ulp of each element of ``x`` (fp32), at least the smallest normal's."""
    _, exp = torch.frexp(x.float().abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp - 8)


def _assert_forward_close(y, a, b, offs, expected):
    """``y`` against ``expected`` (a bf16 result summed in fp32 in another order) on the rows of
    a group, exact zeros after them (the module docstring's bound)."""
    live = int(offs[-1]) if offs.numel() else 0
    mag = grouped_mm_ref(a.float().abs(), b.float().abs(), offs)[:live]
    bound = _ulp(torch.maximum(y[:live].float().abs(), expected[:live].float().abs())) \
        + 2 * a.shape[1] * 2.0**-24 * mag
    err = (y[:live].float() - expected[:live].float()).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert torch.equal(y[live:], torch.zeros_like(y[live:])), "rows of no group must be 0"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("transposed", [False, True], ids=["b", "bT"])
def test_forward_matches_torch_grouped_mm(name, transposed):
    sizes, num_rows = CASES[name]
    a, b, offs = _problem(sizes, num_rows, transposed=transposed)
    expected = torch._grouped_mm(a, b, offs)  # runs on the CPU in torch 2.13
    for config in (SMALL, None):  # several tiles per group; the shape's default config
        _assert_forward_close(grouped_mm(a, b, offs, config=config), a, b, offs, expected)


def test_device_descriptors_and_group_m_give_the_same_bits():
    # host vs device TMA descriptors, group-M 1 vs 3: the same tiles, the same bits
    a, b, offs = _problem(*CASES["tail_rows"])
    base = grouped_mm(a, b, offs, config=SMALL)
    for cfg in (GroupedConfig(block_m=16, block_n=16, block_k=16, num_warps=4, group_m=3,
                              host_descriptors=False),
                GroupedConfig(block_m=16, block_n=16, block_k=16, num_warps=4, group_m=1)):
        assert torch.equal(grouped_mm(a, b, offs, config=cfg), base)


def test_zero_rows_and_zero_experts():
    # M = 0 (empty result, empty gradients) and E = 0 (no group: zeros)
    a, b, offs = _problem([0, 0], 0)
    a.requires_grad_()
    y = grouped_mm(a, b, offs)
    assert y.shape == (0, 40)
    a0 = torch.randn(7, 24).bfloat16()
    b0 = torch.randn(0, 24, 40).bfloat16()
    y0 = grouped_mm(a0, b0, torch.zeros(0, dtype=torch.int32))
    assert torch.equal(y0, torch.zeros(7, 40, dtype=torch.bfloat16))


def test_offsets_out_of_contract_stay_in_bounds():
    # offs past M and decreasing: clamped to M and made non-decreasing on the device
    a, b, _ = _problem([1, 1, 1], 20)
    offs = torch.tensor([9, 4, 50], dtype=torch.int32)
    y = grouped_mm(a, b, offs, config=SMALL)
    expected = grouped_mm_ref(a.float(), b.float(), torch.tensor([9, 9, 20])).bfloat16()
    _assert_forward_close(y, a, b, torch.tensor([9, 9, 20]), expected)


def test_row_tile_bound_covers_every_split():
    # cdiv(M, bm) + E - 1 row tiles hold every group's tiles (last group running to M)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        num_groups = int(torch.randint(1, 9, (1,), generator=gen))
        bm = int(2 ** torch.randint(0, 5, (1,), generator=gen))
        sizes = torch.randint(0, 40, (num_groups,), generator=gen).tolist()
        num_rows = sum(sizes) + int(torch.randint(0, 20, (1,), generator=gen))
        if num_rows == 0:
            continue
        spans = sizes[:-1] + [num_rows - sum(sizes[:-1])]
        needed = sum(-(-s // bm) for s in spans)
        assert needed <= num_row_tiles(num_rows, num_groups, bm), (sizes, num_rows, bm)


def _poisoned(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16)


def test_out_and_input_grad_out_are_written_in_place():
    a, b, offs = _problem(*CASES["tail_rows"])
    num_rows = a.shape[0]
    # both buffers are row slices of larger poisoned buffers: only their rows are written
    out_big, grad_big = _poisoned(num_rows + 4, 40), _poisoned(num_rows + 4, 24)
    out, grad_in = out_big[2:-2], grad_big[2:-2]
    a = a.requires_grad_()
    y = grouped_mm(a, b, offs, out=out, input_grad_out=grad_in, config=SMALL)
    assert y.data_ptr() == out.data_ptr() and y.grad_fn is not None
    assert not out.isnan().any(), "every row of out must be written (tail rows: zeros)"
    _assert_forward_close(out, a.detach(), b, offs, torch._grouped_mm(a.detach(), b, offs))
    assert out_big[:2].isnan().all() and out_big[-2:].isnan().all()
    g = torch.randn(num_rows, 40).bfloat16()
    y.backward(g)
    assert not grad_in.isnan().any()
    assert torch.equal(a.grad, grad_in), "a.grad must hold what was written into input_grad_out"
    assert torch.equal(grad_in[int(offs[-1]):], torch.zeros_like(grad_in[int(offs[-1]):]))
    assert grad_big[:2].isnan().all() and grad_big[-2:].isnan().all()


def _max_err(x, ref):
    return (x.double() - ref).abs().max().item() if x.numel() else 0.0


@pytest.mark.parametrize("name,transposed", [
    ("empty_groups", False),  # empty groups: zero grad_b, rows of every group
    ("tail_rows", True),  # partial tiles, rows of no group, b stored [E, N, K]
    ("prime_e_odd", False),  # prime E, odd sizes
])
def test_gradients_against_fp64_autograd(name, transposed):
    sizes, num_rows = CASES[name]
    a, b, offs = _problem(sizes, num_rows, transposed=transposed)
    g = torch.randn(num_rows, 40).bfloat16()

    ours_a, ours_b = a.clone().requires_grad_(), b.clone().requires_grad_()  # b's layout kept
    grouped_mm(ours_a, ours_b, offs, config=SMALL).backward(g)

    low_a, low_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    grouped_mm_ref(low_a, low_b, offs).backward(g)  # torch's bf16 autograd
    hi_a, hi_b = a.double().requires_grad_(), b.double().requires_grad_()
    grouped_mm_ref(hi_a, hi_b, offs).backward(g.double())  # fp64 oracle

    assert ours_b.grad.dtype == torch.bfloat16 and ours_b.grad.shape == b.shape
    for label, ours, low, hi in (("grad_a", ours_a.grad, low_a.grad, hi_a.grad),
                                 ("grad_b", ours_b.grad, low_b.grad, hi_b.grad)):
        floor = hi.abs().max().item() / 128
        err, base = _max_err(ours, hi), _max_err(low, hi)
        assert err <= 2 * base + floor, f"{label}: error {err} > 2 * {base} + {floor}"
    live = int(offs[-1])
    assert torch.equal(ours_a.grad[live:], torch.zeros_like(ours_a.grad[live:]))
    for e, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(ours_b.grad[e], torch.zeros_like(ours_b.grad[e]))


def test_only_b_requires_grad():
    a, b, offs = _problem(*CASES["empty_groups"])
    b.requires_grad_()
    g = torch.randn(a.shape[0], 40).bfloat16()
    grouped_mm(a, b, offs, config=SMALL).backward(g)
    hi_b = b.detach().double().requires_grad_()
    grouped_mm_ref(a.double(), hi_b, offs).backward(g.double())
    assert b.grad is not None
    assert _max_err(b.grad, hi_b.grad) <= hi_b.grad.abs().max().item() / 128


def _args():
    a, b, offs = _problem([3, 5], 12, k=16, n=16)
    return dict(a=a, b=b, offs=offs)


def _misaligned_a():
    flat = torch.randn(12 * 16 + 8).bfloat16()
    return flat[1:1 + 12 * 16].view(12, 16)  # 2 bytes past an aligned base


ERRORS = [
    ("a", lambda d: [1.0], TypeError, r"a must be a torch\.Tensor, got list"),
    ("a", lambda d: d["a"].float(), TypeError, r"a must have dtype bfloat16, got torch\.float32"),
    ("a", lambda d: d["a"][None], ValueError, r"a must be 2-D \[M, K\], got shape \[1, 12, 16\]"),
    ("a", lambda d: d["a"].t().contiguous().t(), ValueError, r"a must be contiguous"),
    ("a", lambda d: _misaligned_a(), ValueError, r"a must start at a 16-byte aligned address"),
    ("b", lambda d: d["b"][:, :8], ValueError, r"K = a\.shape\[1\] \(16\), got \[2, 8, 16\]"),
    ("b", lambda d: d["b"][:, :, ::2], ValueError,
     r"b must be contiguous or the transpose of a contiguous \[E, N, K\]"),
    ("b", lambda d: d["b"].half(), TypeError, r"b must have dtype bfloat16, got torch\.float16"),
    ("offs", lambda d: d["offs"].long(), TypeError, r"offs must have dtype int32, got torch\.int64"),
    ("offs", lambda d: d["offs"][:1], ValueError, r"offs must have shape \[2\] .*got \[1\]"),
    ("out", lambda d: _poisoned(12, 8), ValueError, r"out must have shape \[12, 16\] .*got \[12, 8\]"),
    ("out", lambda d: torch.zeros(12, 16), TypeError, r"out must have dtype bfloat16"),
    ("out", lambda d: _poisoned(12, 16).requires_grad_(), ValueError,
     r"out must not require grad"),
    ("out", lambda d: d["a"], ValueError, r"a and out must not overlap in memory"),
    ("input_grad_out", lambda d: _poisoned(12, 15), ValueError,
     r"input_grad_out must have shape \[12, 16\]"),
    ("config", lambda d: {"block_m": 16}, TypeError, r"config must be a GroupedConfig or None, got dict"),
]


@pytest.mark.parametrize("arg,make,exc,match", ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_argument(arg, make, exc, match):
    d = _args()
    out = _poisoned(12, 16)
    kwargs = dict(d, out=out)
    kwargs[arg] = make(d)
    with pytest.raises(exc, match=match):
        grouped_mm(**kwargs)
    if arg != "out":
        assert out.isnan().all(), "nothing may be written before the checks pass"


def test_width_rules_and_config_rules():
    # K and N: positive multiples of 8 (torch's 16-byte stride rule, TMA's too)
    a = torch.randn(4, 12).bfloat16()
    b = torch.randn(1, 12, 16).bfloat16()
    with pytest.raises(ValueError, match=r"K \(a\.shape\[1\]\) \(12\) must be a positive multiple of 8"):
        grouped_mm(a, b, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"N \(b\.shape\[2\]\) \(12\) must be a positive multiple of 8"):
        grouped_mm(a[:, :8].contiguous(), b[:, :8, :12].contiguous(),
                   torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"persistent=True is not supported"):
        GroupedConfig(persistent=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9,
                    reason="torch._grouped_mm (bf16) needs an SM90+ GPU")
@pytest.mark.parametrize("align", [8, 1], ids=["groups-x8-vs-torch", "odd-groups-vs-ref"])
def test_gpu_against_torch_grouped_mm(align):
    # groups of multiples of 8 rows: compared with torch._grouped_mm (its backward's WGRAD
    # contracts over the rows, which its TMA wants 16-byte aligned); odd groups: with the
    # per-expert bf16 reference instead. Both: empty groups and 77 rows of no group.
    dev = torch.device("cuda")
    num_experts, k, n = 16, 1024, 768
    sizes = torch.randint(0, 400 // align, (num_experts,)) * align
    sizes[3] = sizes[11] = 0
    num_rows = int(sizes.sum()) + 77
    a = torch.randn(num_rows, k, device=dev).bfloat16()
    b = (torch.randn(num_experts, k, n, device=dev) / k**0.5).bfloat16()
    offs = sizes.cumsum(0).to(dev, torch.int32)
    g = torch.randn(num_rows, n, device=dev).bfloat16()
    live = int(offs[-1])

    ours_a, ours_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    y = grouped_mm(ours_a, ours_b, offs)
    y.backward(g)
    base_a, base_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    if align == 8:
        expected = torch._grouped_mm(base_a, base_b, offs)
    else:
        expected = grouped_mm_ref(base_a, base_b, offs)  # bf16 matmul per expert
    expected.backward(g)
    _assert_forward_close(y.detach(), a, b, offs, expected.detach())

    hi_a, hi_b = a.double().requires_grad_(), b.double().requires_grad_()
    grouped_mm_ref(hi_a, hi_b, offs).backward(g.double())
    for label, ours, base, hi in (
            ("grad_a", ours_a.grad[:live], base_a.grad[:live], hi_a.grad[:live]),
            ("grad_b", ours_b.grad, base_b.grad, hi_b.grad)):
        floor = hi.abs().max().item() / 128
        err, ref_err = _max_err(ours, hi), _max_err(base, hi)
        assert err <= 2 * ref_err + floor, f"{label}: error {err} > 2 * {ref_err} + {floor}"
    assert torch.equal(ours_a.grad[live:], torch.zeros_like(ours_a.grad[live:]))


# --------------------------------------------------------------------------------------------
# scaled_grouped_mm_q: prequantised operands, torch._grouped_mm's shapes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_rebased", "fp8_block"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_scaled_grouped_mm_q_equals_the_kernel_on_padded_tables(fmt, swiglu):
    # the wrapper builds the padded tables from offs on the device: its rows are the bits of
    # the scaled kernel launched on tables built here (the kernel's arithmetic is tested in
    # tests/kernels/scaled); rows of no group are zeros
    counts, k, n = (5, 0, 19), 256, 256
    m = sum(counts) + 3
    x = torch.randn(m, k).bfloat16()
    w = (torch.randn(len(counts), n, k) / k**0.5).bfloat16()
    if fmt == "fp8_block":
        a_q, a_s = fp8_block_quantize(x)
        b_q, b_s = fp8_block_quantize_weight(w)
    else:
        a_q, a_s = mxfp8_quantize(x, dim=-1)
        w8 = mxfp8_quantize_weight(w)
        b_q, b_s = w8.qdata, w8.scales
        if fmt == "mxfp8_rebased":
            a_q, a_s, _ = mxfp8_rebase(a_q, a_s)
            b_q, b_s, _ = mxfp8_rebase(b_q, b_s)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    out_n = n // 2 if swiglu else n
    out = torch.full((m, out_n), float("nan"), dtype=torch.bfloat16)
    got = distmoe.scaled_grouped_mm_q(a_q, a_s, b_q.transpose(1, 2), b_s, offs, out,
                                      format=fmt, swiglu=swiglu)
    assert got is out
    layout = {"mxfp8": MXFP8, "mxfp8_rebased": MXFP8_REBASED, "fp8_block": FP8_BLOCK}[fmt]
    po = torch.tensor([0, 128, 128, 256], dtype=torch.int32)
    ro = torch.tensor([0, 5, 5, 24], dtype=torch.int32)
    ref = torch.full_like(out, float("nan"))
    scaled_grouped_mm(a_q, a_s, b_q, b_s, po, ro, ref, layout=layout, swiglu=swiglu)
    live = sum(counts)
    assert torch.equal(got[:live], ref[:live])
    assert torch.equal(got[live:], torch.zeros(m - live, out_n, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"b_q must be the transpose of a contiguous"):
        distmoe.scaled_grouped_mm_q(a_q, a_s, b_q.transpose(1, 2).contiguous(), b_s, offs,
                                    format=fmt)
    with pytest.raises(ValueError, match=r"format \('fp4'\) must be one of"):
        distmoe.scaled_grouped_mm_q(a_q, a_s, b_q.transpose(1, 2), b_s, offs, format="fp4")
