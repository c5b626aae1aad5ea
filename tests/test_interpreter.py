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
