"""Route gradients (route_grads, push_route_grads, reduce_routes) against plain-PyTorch references.

Layouts, poisoning and tolerances: :mod:`backward_cases` (tests/kernels/backward_cases.py).
"""

import pytest
import torch
from backward_cases import DEVICE, assert_bf16_close, make_ids, poisoned, same_bits

from distmoe.kernels.movement.route_grad import (
    RouteGradConfig,
    push_route_grads,
    reduce_routes,
    reduce_routes_ref,
    route_grads,
    route_grads_ref,
)


def _route_problem(num_tokens, t_max, top_k, hidden):
    ids = make_ids(num_tokens, top_k, [0, 1, 2, 3]).to(torch.int16).to(DEVICE)  # int16 ids
    active = ids.long().reshape(-1) >= 0
    scores = torch.rand(num_tokens, top_k, device=DEVICE) * (ids >= 0)
    grad_y = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    h3 = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    h3[: num_tokens * top_k][~active] = float("nan")  # inactive routes: never read
    return ids, active, scores, grad_y, h3


@pytest.mark.parametrize(
    "hidden,block_d,top_k",
    [
        (40, 16, 3),  # D tail in the last step
        (64, 64, 1),  # one step; K = 1
    ],
)
def test_route_grads(hidden, block_d, top_k):
    num_tokens, t_max = 7, 9  # odd T; buffers sized for T_max > T
    ids, active, scores, grad_y, h3 = _route_problem(num_tokens, t_max, top_k, hidden)
    grad_routes = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    before = grad_routes.clone()
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)

    config = RouteGradConfig(block_rows=4, block_d=block_d, num_warps=4)
    route_grads(grad_y, h3, ids, scores, grad_routes, grad_scores, config=config)

    ref_routes, ref_scores = route_grads_ref(grad_y, h3, ids, scores)
    # grad_routes: one fp32 product rounded to bf16, so bit-exact.
    n = num_tokens * top_k
    assert same_bits(grad_routes[:n][active], ref_routes[active].bfloat16())
    assert same_bits(grad_routes[:n][~active], before[:n][~active])  # inactive: not written
    assert same_bits(grad_routes[n:], before[n:])  # beyond T*K: not written
    # grad_scores: fp32 sums of exact bf16 products; only the summation order differs.
    torch.testing.assert_close(grad_scores, ref_scores.float(), rtol=1e-5, atol=1e-5)
    assert (grad_scores.reshape(-1)[~active] == 0).all()


@pytest.mark.parametrize(
    "mode",
    [
        "addr",  # h3 rows at a device-side address inside a larger buffer
        "addr_in_place",  # h3_addr names the rows of grad_routes_out (combine buffer)
        "tensor_in_place",  # h3_routes is grad_routes_out
    ],
)
def test_route_grads_h3_addr(mode):
    num_tokens, t_max, top_k, hidden = 7, 9, 3, 40
    ids, active, scores, grad_y, h3 = _route_problem(num_tokens, t_max, top_k, hidden)
    config = RouteGradConfig(block_rows=4, block_d=16, num_warps=4)  # 3 column steps, D tail
    # The plain path (separate tensors) is the reference: same kernel arithmetic, bit-exact.
    plain_routes = poisoned(t_max * top_k, hidden)
    plain_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    route_grads(grad_y, h3, ids, scores, plain_routes, plain_scores, config=config)

    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    if mode == "addr":
        lead = 5  # route row 0 sits 5 rows into the buffer (a non-zero, 16-byte aligned offset)
        buffer = torch.randn(lead + t_max * top_k + 2, hidden, device=DEVICE).bfloat16()
        buffer[lead : lead + t_max * top_k] = h3
        buffer_before = buffer.clone()
        addr = torch.tensor([buffer[lead].data_ptr()], dtype=torch.int64, device=DEVICE)
        grad_routes = poisoned(t_max * top_k, hidden)
        route_grads(
            grad_y, None, ids, scores, grad_routes, grad_scores, h3_addr=addr, config=config
        )
        assert same_bits(buffer, buffer_before)  # h3 rows: read only
        assert same_bits(grad_routes, plain_routes)  # inactive and spare rows still poison
    else:
        grad_routes = h3.clone()  # the combine buffer holds the routes' results
        if mode == "addr_in_place":
            addr = torch.tensor([grad_routes.data_ptr()], dtype=torch.int64, device=DEVICE)
            route_grads(
                grad_y, None, ids, scores, grad_routes, grad_scores, h3_addr=addr, config=config
            )
        else:
            route_grads(grad_y, grad_routes, ids, scores, grad_routes, grad_scores, config=config)
        n = num_tokens * top_k
        expected = h3.clone()  # inactive routes and rows past T*K keep the h3 values
        expected[:n][active] = plain_routes[:n][active]
        assert same_bits(grad_routes, expected)
    assert same_bits(grad_scores, plain_scores)


PUSH_ROWS = 12  # destination rows per rank: room to spare, unused rows keep their poison


def _push_destinations(ids, active, hidden):
    """Two ranks (experts 0-1 on rank 0, 2-3 on rank 1): each active route's destination
    rank, its row there (a random permutation of each rank's rows; one active route that its
    rank does not execute gets -1), both ranks' poisoned row buffers and their addresses.
    Returns (dest_rank [T*K], dest_rows int32 [T, K] on DEVICE, bufs, bases)."""
    num_tokens, top_k = ids.shape
    dest_rank = torch.where(active, ids.long().reshape(-1) // 2, -1)
    dest_rows = torch.full((num_tokens * top_k,), -1, dtype=torch.int32)
    for r in (0, 1):
        mine = (dest_rank == r).nonzero().flatten()
        dest_rows[mine] = torch.randperm(PUSH_ROWS)[: mine.numel()].int()
    dest_rows[active.nonzero().flatten()[:1]] = -1
    bufs = [poisoned(PUSH_ROWS, hidden) for _ in range(2)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEVICE)
    return dest_rank, dest_rows.to(DEVICE).reshape(num_tokens, top_k), bufs, bases


def _assert_pushed(bufs, dest_rank, dest_rows, row_of_route):
    """Each rank's buffer holds ``row_of_route(route)`` at every pushed route's row, bit for
    bit, and its poison everywhere else."""
    flat_rows = dest_rows.reshape(-1).cpu()
    for r, buf in enumerate(bufs):
        expected = poisoned(PUSH_ROWS, buf.shape[1])
        for route in ((dest_rank == r) & (flat_rows >= 0)).nonzero().flatten().tolist():
            expected[flat_rows[route]] = row_of_route(route)
        assert same_bits(buf, expected)


@pytest.mark.parametrize("h3_addr", [False, True], ids=["h3_tensor", "h3_addr"])
def test_route_grads_push(h3_addr):
    """Push mode: each active route's row lands at its destination rank's row (two ranks'
    buffers here, experts 0-1 on rank 0 and 2-3 on rank 1, rows a random permutation);
    bit-exact against the plain path, and nothing else of either buffer is written."""
    num_tokens, t_max, top_k, hidden = 7, 9, 3, 40
    ids, active, scores, grad_y, h3 = _route_problem(num_tokens, t_max, top_k, hidden)
    config = RouteGradConfig(block_rows=4, block_d=16, num_warps=4)
    plain_routes = poisoned(t_max * top_k, hidden)
    plain_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    route_grads(grad_y, h3, ids, scores, plain_routes, plain_scores, config=config)

    dest_rank, dest_rows, bufs, bases = _push_destinations(ids, active, hidden)
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    h3_before = h3.clone()
    if h3_addr:
        addr = torch.tensor([h3.data_ptr()], dtype=torch.int64, device=DEVICE)
        route_grads(grad_y, None, ids, scores, None, grad_scores, h3_addr=addr,
                    dest_rows=dest_rows, dest_bases=bases, experts_per_rank=2, config=config)
    else:
        route_grads(grad_y, h3, ids, scores, None, grad_scores, dest_rows=dest_rows,
                    dest_bases=bases, experts_per_rank=2, config=config)
    assert same_bits(grad_scores, plain_scores)
    assert same_bits(h3, h3_before)
    _assert_pushed(bufs, dest_rank, dest_rows, lambda route: plain_routes[route])

    # push mode takes no grad_routes_out, and all three push arguments
    with pytest.raises(ValueError, match="grad_routes_out must be None in push mode"):
        route_grads(grad_y, h3, ids, scores, plain_routes, grad_scores, dest_rows=dest_rows,
                    dest_bases=bases, experts_per_rank=2)
    with pytest.raises(ValueError, match=r"experts_per_rank \(None\) must be an int >= 1"):
        route_grads(grad_y, h3, ids, scores, None, grad_scores, dest_rows=dest_rows,
                    dest_bases=bases)
    with pytest.raises(TypeError, match="dest_rows"):
        route_grads(grad_y, h3, ids, scores, None, grad_scores, dest_rows=dest_rows.long(),
                    dest_bases=bases, experts_per_rank=2)
    with pytest.raises(TypeError, match="grad_routes_out must be a torch.Tensor unless"):
        route_grads(grad_y, h3, ids, scores, None, grad_scores)


def test_push_route_grads():
    """Every executed route's destination row receives grad_y[t] bit for bit (unscaled);
    every active route's score lands as the fp32 at the start of its own route row; nothing
    else of either rank's rows or the route rows is written."""
    num_tokens, t_max, top_k, hidden = 7, 9, 3, 40
    ids, active, scores, grad_y, _ = _route_problem(num_tokens, t_max, top_k, hidden)
    dest_rank, dest_rows, bufs, bases = _push_destinations(ids, active, hidden)
    route_rows = poisoned(t_max * top_k, hidden)
    config = RouteGradConfig(block_rows=4, block_d=16, num_warps=4)  # 3 column steps, D tail
    push_route_grads(grad_y, ids, scores, route_rows, dest_rows=dest_rows, dest_bases=bases,
                     experts_per_rank=2, config=config)

    _assert_pushed(bufs, dest_rank, dest_rows, lambda route: grad_y[route // top_k])
    expected = poisoned(t_max * top_k, hidden).view(torch.float32)
    n = num_tokens * top_k
    expected[:n][active, 0] = scores.reshape(-1)[active]
    assert same_bits(route_rows.view(torch.float32), expected)

    with pytest.raises(ValueError, match=r"score_rows must have shape \[R, 40\] with R >= "):
        push_route_grads(grad_y, ids, scores, route_rows[:n - 1], dest_rows=dest_rows,
                         dest_bases=bases, experts_per_rank=2)
    with pytest.raises(ValueError, match=r"experts_per_rank \(0\) must be an int >= 1"):
        push_route_grads(grad_y, ids, scores, route_rows, dest_rows=dest_rows,
                         dest_bases=bases, experts_per_rank=0)
    with pytest.raises(TypeError, match="scores must have dtype"):
        push_route_grads(grad_y, ids, scores.double(), route_rows, dest_rows=dest_rows,
                         dest_bases=bases, experts_per_rank=2)


def test_reduce_routes_score_parts():
    """With score_rows: grad_scores is the fp32 sum of each active route's parts (values
    1..P of its row, value 0 being the score), 0 for inactive routes; grad_x unchanged."""
    num_tokens, top_k, t_max, hidden, parts = 9, 4, 10, 48, 5
    ids = make_ids(num_tokens, top_k, [0, 1, 2, 3, 4]).to(DEVICE)
    active = ids.reshape(-1) >= 0
    rows = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    rows[: num_tokens * top_k][~active] = float("nan")
    route_rows = poisoned(t_max * top_k, hidden)  # values past 1 + P: never read
    values = route_rows.view(torch.float32)
    values[:, : 1 + parts] = torch.randn(t_max * top_k, 1 + parts, device=DEVICE)
    values[: num_tokens * top_k][~active] = float("nan")  # inactive: never read
    route_rows_before = route_rows.clone()
    grad_x, plain_x = poisoned(num_tokens, hidden), poisoned(num_tokens, hidden)
    grad_scores = poisoned(num_tokens, top_k, dtype=torch.float32)
    config = RouteGradConfig(block_rows=4, block_d=32)
    reduce_routes(rows, ids, plain_x, config=config)
    reduce_routes(rows, ids, grad_x, score_rows=route_rows, score_parts=parts,
                  grad_scores_out=grad_scores, config=config)
    assert same_bits(grad_x, plain_x) and same_bits(route_rows, route_rows_before)
    want = values[: num_tokens * top_k, 1 : 1 + parts].double().sum(dim=1)
    want = torch.where(active, want, 0.0).reshape(num_tokens, top_k)
    # fp32 sum of 5 values in a tree order: within 5 * 2^-24 of the exact sum, relative to
    # the sum of magnitudes
    mag = values[: num_tokens * top_k, 1 : 1 + parts].double().abs().sum(dim=1)
    mag = torch.where(active, mag, 0.0).reshape(num_tokens, top_k)
    assert ((grad_scores.double() - want).abs() <= 5 * 2.0**-24 * mag).all()
    assert (grad_scores.reshape(-1)[~active] == 0).all()

    with pytest.raises(ValueError, match=r"score_parts \(24\) must be an int in \[1, D/2 - 1"):
        reduce_routes(rows, ids, grad_x, score_rows=route_rows, score_parts=24,
                      grad_scores_out=grad_scores)
    with pytest.raises(TypeError, match="grad_scores_out must be a torch.Tensor"):
        reduce_routes(rows, ids, grad_x, score_rows=route_rows, score_parts=parts)


def test_reduce_routes():
    num_tokens, top_k, t_max, hidden = 9, 4, 10, 48
    ids = make_ids(num_tokens, top_k, [0, 1, 2, 3, 4]).to(DEVICE)
    active = ids.reshape(-1) >= 0
    rows = torch.randn(t_max * top_k, hidden, device=DEVICE).bfloat16()
    rows[: num_tokens * top_k][~active] = float("nan")  # inactive: never read
    grad_x = poisoned(num_tokens, hidden)

    reduce_routes(rows, ids, grad_x, config=RouteGradConfig(block_rows=4, block_d=32))

    # fp32 sum of at most K bf16 rows, one rounding to bf16.
    assert_bf16_close(grad_x, reduce_routes_ref(rows, ids))
    assert same_bits(grad_x[0], torch.zeros(hidden, dtype=torch.bfloat16, device=DEVICE))
