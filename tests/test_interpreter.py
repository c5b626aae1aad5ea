"""The interpreter corrections (bf16 tl.dot, fp32->bf16 rounding) match torch on CPU and the
GPU's behaviour; on a GPU the same kernels run natively and must agree too."""

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_and_round_kernel(a_ptr, b_ptr, c_ptr, r_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    c = tl.dot(a, b)
    tl.store(c_ptr + i[:, None] * N + i[None, :], c)
    tl.store(r_ptr + i[:, None] * N + i[None, :], c.to(tl.bfloat16))


def test_bf16_dot_and_round_to_nearest_even():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(16, 16, device=dev).bfloat16()
    b = torch.randn(16, 16, device=dev).bfloat16()
    c = torch.full((16, 16), float("nan"), device=dev)
    r = torch.full((16, 16), float("nan"), device=dev).bfloat16()
    _dot_and_round_kernel[(1,)](a, b, c, r, N=16)
    # fp32 products of bf16 values are exact; only the summation order differs.
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-6, atol=1e-5)
    assert torch.equal(r, c.bfloat16())  # round-to-nearest-even, bit for bit


@triton.jit
def _xor_and_sort_kernel(x_ptr, xor0_ptr, xor1_ptr, xor_all_ptr, sorted_ptr, desc_ptr,
                         R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    x = tl.load(x_ptr + r[:, None] * C + c[None, :])
    tl.store(xor0_ptr + c, tl.xor_sum(x, 0))
    tl.store(xor1_ptr + r, tl.xor_sum(x, 1))
    tl.store(xor_all_ptr, tl.xor_sum(tl.reshape(x, [R * C]), 0))
    tl.store(sorted_ptr + r[:, None] * C + c[None, :], tl.sort(x, 1))
    tl.store(desc_ptr + r[:, None] * C + c[None, :], tl.sort(x, 1, descending=True))


def _xor_reduce(t, dim):
    out = t.select(dim, 0).clone()
    for i in range(1, t.shape[dim]):
        out ^= t.select(dim, i)
    return out


def test_xor_sum_and_sort_match_torch():
    """``tl.xor_sum`` (a numpy reduction in the interpreter since the nested-call patch) and
    ``tl.sort``, which uses it in every step, against torch on random values of both signs
    and every integer width the routing kernels sort, ascending and descending."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.int16, torch.int32, torch.int64):
        x = torch.randint(-30000, 30000, (8, 64), generator=g).to(dtype).to(dev)
        xor0, xor1, xor_all, srt, desc = (torch.full(shape, -7, dtype=dtype, device=dev)
                                          for shape in ((64,), (8,), (1,), (8, 64), (8, 64)))
        _xor_and_sort_kernel[(1,)](x, xor0, xor1, xor_all, srt, desc, R=8, C=64)
        assert torch.equal(xor0, _xor_reduce(x, 0))
        assert torch.equal(xor1, _xor_reduce(x, 1))
        assert torch.equal(xor_all, _xor_reduce(x.reshape(-1), 0).reshape(1))
        assert torch.equal(srt, torch.sort(x, 1).values)
        assert torch.equal(desc, torch.sort(x, 1, descending=True).values)
