"""The forward kernels chained (W13, W2, combine) on one rank, and replayed in a CUDA graph.

Layouts, poisoning and tolerances: :mod:`kernel_cases` (tests/kernels/kernel_cases.py).
"""

import math

import pytest
import torch
from kernel_cases import (
    BM,
    DEVICE,
    W2_SMALL,
    W13_SMALL,
    addr,
    assert_untouched,
    device_int,
    poisoned,
    random_weights,
)

from distmoe.kernels.movement.combine import combine
from distmoe.kernels.w2_forward.triton import w2_scatter
from distmoe.kernels.w13_forward.triton import gather_w13_swiglu


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


@pytest.mark.gpu
def test_gpu_forward_chain():
    run_forward_chain(256, 4, 8, 512, 384, block_m=128)


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
