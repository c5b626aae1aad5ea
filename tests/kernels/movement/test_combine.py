"""Owner combine against the plain-PyTorch reference.

Layouts, poisoning and tolerances: :mod:`kernel_cases` (tests/kernels/kernel_cases.py).
"""

import pytest
import torch
from kernel_cases import DEVICE, assert_bf16_close, assert_bits_equal, poisoned

from distmoe.kernels.movement.combine import CombineConfig, combine, combine_ref


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


@pytest.mark.gpu
def test_gpu_combine_large():
    run_combine_case(1000, 1024, 8, 4096, id_dtype=torch.int16, score_dtype=torch.float32, config=None)  # fmt: skip
