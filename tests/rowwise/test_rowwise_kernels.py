"""The rowwise movement kernels in one process: a "group" is a list of local tensors whose
addresses form the base table, so every kernel runs against its plain-PyTorch reference
without a heap. Movement is compared bit for bit (bf16 bits, poisoned destinations); the
fp32 reductions too, against references that sum in the kernels' order (k order) on the CPU.
"""

import pytest
import torch
from rowwise_cases import assert_bits_equal, make_problem, poison_, poisoned

from distmoe.kernels.movement.combine import CombineConfig
from distmoe.kernels.movement.rowwise_get import (
    rowwise_combine_get,
    rowwise_combine_get_ref,
    rowwise_gather,
    rowwise_gather_ref,
)
from distmoe.kernels.movement.rowwise_put import RowwiseConfig, rowwise_put, rowwise_put_ref
from distmoe.rowwise.transport import reduce


def _bases(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


# world 3 (one rank without tokens), D = 20 (not a multiple of 8: no alignment hints),
# K = 1, 2, 3; the route maps in mixed dtypes (each map is read on its own)
CASES = [
    pytest.param(3, 2, 24, torch.int32, torch.int64, id="w3-k2-d24-i32-i64"),
    pytest.param(3, 3, 20, torch.int8, torch.int16, id="w3-k3-d20-i8-i16"),
    pytest.param(2, 1, 40, torch.int64, torch.int32, id="w2-k1-d40-i64-i32"),
]


@pytest.mark.parametrize("world,top_k,hidden,rank_dtype,row_dtype", CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_put_moves_rows_bit_exact(world, top_k, hidden, rank_dtype, row_dtype, weighted):
    p = make_problem(world, 11, top_k=top_k, hidden=hidden, bad=True)
    outs = [poisoned(p.rows_per_rank, hidden) for _ in range(world)]
    expected = [o.clone() for o in outs]
    bad = torch.zeros(1, dtype=torch.int64)
    # small blocks: several programs, and routes of one token split over programs
    config = RowwiseConfig(block_r=4, block_d=16, num_warps=1)
    for s in range(world):
        probs = p.probs[s] if weighted else None
        rowwise_put(p.x[s], p.ranks[s].to(rank_dtype), p.rows[s].to(row_dtype), _bases(outs),
                    p.rows_per_rank, probs=probs, bad_count=bad, config=config)
        assert rowwise_put_ref(p.x[s], p.ranks[s], p.rows[s], expected, probs) == p.bad[s]
    for r in range(world):
        assert_bits_equal(outs[r], expected[r], f"rank {r}'s out")  # poison where unwritten
    assert int(bad) == sum(p.bad) > 0


@pytest.mark.parametrize("world,top_k,hidden,rank_dtype,row_dtype", CASES)
def test_gather_pulls_rows_bit_exact_and_zero_fills(world, top_k, hidden, rank_dtype,
                                                    row_dtype):
    p = make_problem(world, 12, top_k=top_k, hidden=hidden, bad=True)
    bad = torch.zeros(1, dtype=torch.int64)
    for s in range(world):
        n = p.num_tokens[s]
        out = poisoned(n * top_k, hidden)  # invalid routes must be written with zeros
        is_read = torch.full((n * top_k,), 7, dtype=torch.int8)
        rowwise_gather(_bases(p.src), p.rows_per_rank, p.ranks[s].reshape(-1).to(rank_dtype),
                       p.rows[s].reshape(-1).to(row_dtype), out, is_read=is_read,
                       bad_count=bad, config=RowwiseConfig(block_r=2, block_d=8, num_warps=1))
        exp_rows, exp_read, exp_bad = rowwise_gather_ref(list(p.src), p.ranks[s].reshape(-1),
                                                         p.rows[s].reshape(-1))
        assert_bits_equal(out, exp_rows, f"rank {s}'s gathered rows")
        assert torch.equal(is_read, exp_read)
        assert exp_bad == p.bad[s]
        # invalid and bad routes read +0.0 exactly (bits 0), never the poison
        assert torch.all(out.view(torch.int16)[exp_read < 0] == 0)
    assert int(bad) == sum(p.bad) > 0


# unweighted and fp32 weights on every case; bf16 and fp16 weights on one
COMBINE_CASES = [
    pytest.param(*case.values, probs_dtype, id=f"{case.id}-{str(probs_dtype)[6:]}")
    for case in CASES for probs_dtype in (None, torch.float32)
] + [pytest.param(*CASES[1].values, dt, id=f"{CASES[1].id}-{str(dt)[6:]}")
     for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("world,top_k,hidden,rank_dtype,row_dtype,probs_dtype", COMBINE_CASES)
def test_fused_and_unfused_combine_agree_bit_for_bit(world, top_k, hidden, rank_dtype,
                                                     row_dtype, probs_dtype):
    p = make_problem(world, 13, top_k=top_k, hidden=hidden, bad=True)
    bad = torch.zeros(1, dtype=torch.int64)
    for s in range(world):
        n = p.num_tokens[s]
        ranks, rows = p.ranks[s].to(rank_dtype), p.rows[s].to(row_dtype)
        probs = None if probs_dtype is None else p.probs[s].to(probs_dtype)  # NaN unread
        fused = poisoned(n, hidden)
        rowwise_combine_get(_bases(p.src), p.rows_per_rank, ranks, rows, fused, probs=probs,
                            bad_count=bad, config=CombineConfig(block_t=4, block_d=16,
                                                                num_warps=1))
        gathered = poison_(torch.empty(n, top_k, hidden, dtype=torch.bfloat16))
        is_read = torch.empty(n, top_k, dtype=torch.int8)
        rowwise_gather(_bases(p.src), p.rows_per_rank, ranks, rows, gathered, is_read=is_read)
        unfused = reduce(gathered, is_read, probs)
        assert_bits_equal(fused, unfused, f"rank {s}: fused vs unfused combine")
        expected = rowwise_combine_get_ref(list(p.src), p.ranks[s], p.rows[s], probs)
        assert_bits_equal(fused, expected, f"rank {s}: combine vs k-order fp32 reference")
        assert not torch.isnan(fused.float()).any()  # the poison of unread rows never leaks
    assert int(bad) == sum(p.bad) > 0


def test_empty_calls_launch_nothing():
    # N = 0 token rows, and an empty base table with only invalid routes
    x = torch.empty(0, 16, dtype=torch.bfloat16)
    maps = torch.empty(0, 2, dtype=torch.int32)
    rowwise_put(x, maps, maps, torch.zeros(1, dtype=torch.int64), 4)
    y = torch.empty(0, 16, dtype=torch.bfloat16)
    rowwise_combine_get(torch.zeros(1, dtype=torch.int64), 4, maps, maps, y)
    out = poisoned(3, 8)
    neg = torch.full((3,), -1, dtype=torch.int32)
    rowwise_gather(torch.zeros(0, dtype=torch.int64), 4, neg, neg, out)
    assert torch.all(out.view(torch.int16) == 0)  # invalid routes read zeros


def test_launcher_errors_name_the_argument():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    maps = torch.zeros(4, 2, dtype=torch.int32)
    bases = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"x must have dtype bfloat16 or uint8, got torch.float32"):
        rowwise_put(x.float(), maps, maps, bases, 4)
    with pytest.raises(TypeError, match=r"dst_ranks must have dtype int8 or int16"):
        rowwise_put(x, maps.to(torch.uint8), maps, bases, 4)
    with pytest.raises(ValueError, match=r"dst_rows must have shape \[4, 2\]"):
        rowwise_put(x, maps, maps[:, :1].contiguous(), bases, 4)
    with pytest.raises(ValueError, match=r"num_rows \(-1\) must be a non-negative int"):
        rowwise_put(x, maps, maps, bases, -1)
    with pytest.raises(ValueError, match=r"out must have shape \[4\] \+ \[D\]"):
        rowwise_gather(bases, 4, maps[:, 0].contiguous(), maps[:, 0].contiguous(), x[:3])
    with pytest.raises(TypeError, match=r"config must be a CombineConfig"):
        rowwise_combine_get(bases, 4, maps, maps, x, config=RowwiseConfig())
    with pytest.raises(ValueError, match=r"block_r \(3\) must be a power-of-two int"):
        RowwiseConfig(block_r=3)
