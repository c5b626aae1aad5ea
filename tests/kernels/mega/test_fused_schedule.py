"""The fused W13 + W2 schedule (:func:`distmoe.kernels.base.tiles.fused_tile`): position by
position it must equal the period-by-period reference, cover every tile of both GEMMs once,
and put every W2 tile after all the W13 tiles of its row block (the fused kernel's W2 tiles
wait for those; a W2 tile scheduled before one of them on the same program would wait for
ever). Run on the interpreter on CPU (integer arithmetic only), on the device otherwise."""

from distmoe.kernels.base.interpreter import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from distmoe.kernels.base.tiles import fused_schedule_ref, fused_tile, swizzle_tile  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _schedule_kernel(out_ptr, num_pid_m, total, N13: tl.constexpr, N2: tl.constexpr,
                     GROUP_M: tl.constexpr, LAG: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_w2, idx = fused_tile(tl.minimum(t, total - 1), num_pid_m, N13, N2, GROUP_M, LAG)
    tl.store(out_ptr + 2 * t, is_w2.to(tl.int32), mask=t < total)
    tl.store(out_ptr + 2 * t + 1, idx, mask=t < total)


@triton.jit
def _swizzle_kernel(out_ptr, num_pid_m, total, N: tl.constexpr, GROUP_M: tl.constexpr,
                    BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # lanes past the end compute the last tile (a short group past it divides by zero)
    pid_m, pid_n = swizzle_tile(tl.minimum(t, total - 1), num_pid_m, N, GROUP_M)
    tl.store(out_ptr + 2 * t, pid_m, mask=t < total)
    tl.store(out_ptr + 2 * t + 1, pid_n, mask=t < total)


def _run(kernel, total, *args, **meta):
    out = torch.full((2 * max(total, 1),), -7, dtype=torch.int32, device=DEVICE)
    block = 256
    kernel[(triton.cdiv(max(total, 1), block),)](out, *args, BLOCK=block, **meta)
    return out.view(-1, 2).cpu().tolist()[:total]


CASES = [  # (row blocks, W13 column tiles, W2 column tiles, group_m, lag)
    (1, 6, 8, 8, 1), (7, 6, 8, 8, 1), (8, 6, 8, 8, 2), (9, 6, 16, 8, 1), (37, 6, 16, 8, 2),
    (40, 16, 16, 8, 3), (23, 3, 5, 4, 1), (64, 6, 8, 8, 9), (5, 2, 3, 2, 5),
]


@pytest.mark.parametrize("blocks,n13,n2,group_m,lag", CASES)
def test_fused_schedule_matches_reference_and_orders_w2_after_w13(blocks, n13, n2, group_m,
                                                                   lag):
    total = blocks * (n13 + n2)
    got = _run(_schedule_kernel, total, blocks, total, N13=n13, N2=n2, GROUP_M=group_m,
               LAG=lag)
    want = [[int(w2), i] for w2, i in fused_schedule_ref(blocks, n13, n2, group_m, lag)]
    assert got == want
    assert sorted(i for w2, i in got if not w2) == list(range(blocks * n13))
    assert sorted(i for w2, i in got if w2) == list(range(blocks * n2))
    # the row block of every tile, by the same swizzle the kernel applies
    m13 = _run(_swizzle_kernel, blocks * n13, blocks, blocks * n13, N=n13, GROUP_M=group_m)
    m2 = _run(_swizzle_kernel, blocks * n2, blocks, blocks * n2, N=n2, GROUP_M=group_m)
    last13 = {}
    for pos, (w2, i) in enumerate(got):
        if not w2:
            last13[m13[i][0]] = pos
    groups = -(-blocks // group_m)
    for pos, (w2, i) in enumerate(got):
        if w2:
            block = m2[i][0]
            assert pos > last13[block]
            # at least min(lag, groups) W13 groups lie between (all of them when lag >= groups)
            later13 = sum(1 for p in range(last13[block] + 1, pos) if not got[p][0])
            if block // group_m + min(lag, groups) < groups:
                assert later13 >= (min(lag, groups) - 1) * group_m * n13
