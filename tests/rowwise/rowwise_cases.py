"""Problems and checks shared by the rowwise tests.

A *problem* is a whole group's routes, drawn from a seed so that every rank process and the
test process build the same one:

* rank s has ``N[s]`` token rows (one rank of a group of 3 or more has none), K routes per
  token, rows of width D; every rank's buffers hold R rows;
* each route is valid (a destination rank and a row of its own: no two routes of the group
  share a row), or invalid (rank -1, row -1 or both, about 1 in 5), or, with ``bad=True``,
  bad (rank >= world size or row >= R, the other coordinate valid, about 1 in 6);
* probabilities are in (0, 1); an invalid or bad route's is NaN (it must never be read).

Buffers are poisoned with the bf16 bits 0x7FFF (a NaN other than torch's 0x7FC0) before a
PUT, so a row that was not written cannot pass for one that was, and the expected values
are never zeros left by an allocation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

POISON = 0x7FFF  # bf16 bits: a NaN that no computation produces


@dataclass(frozen=True)
class Problem:
    """A group's routes. ``ranks[s]`` / ``rows[s]``: int ``[N[s], K]`` of source rank s;
    ``probs[s]``: fp32 ``[N[s], K]``; ``x[s]``: bf16 ``[N[s], D]``; ``src[r]``: bf16
    ``[R, D]`` (rank r's expert_out, poison where no valid route reads); ``bad[s]``: bad
    routes of rank s."""

    world: int
    num_tokens: tuple[int, ...]
    top_k: int
    hidden: int
    rows_per_rank: int
    ranks: tuple[torch.Tensor, ...]
    rows: tuple[torch.Tensor, ...]
    probs: tuple[torch.Tensor, ...]
    x: tuple[torch.Tensor, ...]
    src: tuple[torch.Tensor, ...]
    bad: tuple[int, ...]


def token_counts(world: int) -> tuple[int, ...]:
    # different N per rank; from 3 ranks on, rank 2 has no token rows
    return tuple((6, 5, 0, 7)[s] for s in range(world))


def make_problem(world: int, seed: int, *, top_k: int = 2, hidden: int = 24,
                 bad: bool = False) -> Problem:
    g = torch.Generator().manual_seed(seed)
    num_tokens = token_counts(world)
    total = sum(num_tokens) * top_k
    rows_per_rank = -(-total // world) + 3  # room for every route, and spare rows
    ranks, rows, probs, xs, bads = [], [], [], [], []
    free = [torch.randperm(rows_per_rank, generator=g).tolist() for _ in range(world)]
    for n in num_tokens:
        r = torch.empty(n, top_k, dtype=torch.int64)
        w = torch.empty(n, top_k, dtype=torch.int64)
        for t in range(n):
            for k in range(top_k):
                u = float(torch.rand((), generator=g))
                dest = int(torch.randint(0, world, (), generator=g))
                if not free[dest]:  # this rank is full: any rank with a free row
                    dest = next(d for d in range(world) if free[d])
                row = free[dest].pop()
                if u < 0.07:
                    r[t, k], w[t, k] = -1, row
                elif u < 0.14:
                    r[t, k], w[t, k] = dest, -1
                elif u < 0.2:
                    r[t, k], w[t, k] = -1, -1
                elif bad and u < 0.28:
                    r[t, k], w[t, k] = world + int(torch.randint(0, 3, (), generator=g)), row
                elif bad and u < 0.36:
                    r[t, k], w[t, k] = dest, rows_per_rank + int(
                        torch.randint(0, 4, (), generator=g))
                else:
                    r[t, k], w[t, k] = dest, row
        if n >= 3:
            r[1] = -1  # a token with no valid route
            r[2, top_k - 1], w[2, 0] = -1, -1  # an invalid rank, an invalid row
            if bad:  # at least one bad rank and one bad row
                r[0, 0] = world + 1
                w[n - 1, top_k - 1] = rows_per_rank
        num_bad = int(((r >= 0) & (w >= 0) & ((r >= world) | (w >= rows_per_rank))).sum())
        p = torch.rand(n, top_k, generator=g) * 0.9 + 0.05
        p[~is_valid(r, w, world, rows_per_rank)] = float("nan")
        ranks.append(r)
        rows.append(w)
        probs.append(p)
        xs.append(torch.randn(n, hidden, generator=g).bfloat16())
        bads.append(num_bad)
    src = []
    for d in range(world):
        s_d = torch.randn(rows_per_rank, hidden, generator=g).bfloat16()
        read = torch.zeros(rows_per_rank, dtype=torch.bool)
        for r, w in zip(ranks, rows, strict=True):
            ok = is_valid(r, w, world, rows_per_rank) & (r == d)
            read[w[ok]] = True
        s_d.view(torch.int16)[~read] = POISON
        src.append(s_d)
    return Problem(world, num_tokens, top_k, hidden, rows_per_rank, tuple(ranks), tuple(rows),
                   tuple(probs), tuple(xs), tuple(src), tuple(bads))


def on_device(p: Problem, device) -> Problem:
    """The problem with every tensor on ``device`` (a GPU rank's copy)."""
    moved = {f: tuple(t.to(device) for t in getattr(p, f))
             for f in ("ranks", "rows", "probs", "x", "src")}
    return dataclasses.replace(p, **moved)


def to_cpu(obj):
    """``obj`` (nested dicts, tuples, lists of tensors) with every tensor on the CPU: results
    cross back from GPU ranks as plain CPU tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def is_valid(ranks: torch.Tensor, rows: torch.Tensor, world: int, num_rows: int) -> torch.Tensor:
    return (ranks >= 0) & (rows >= 0) & (ranks < world) & (rows < num_rows)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a bf16 tensor with the poison bits, in place."""
    t.view(torch.int16).fill_(POISON)
    return t


def poisoned(rows: int, hidden: int) -> torch.Tensor:
    return poison_(torch.empty(rows, hidden, dtype=torch.bfloat16))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The int16 bits of a bf16 tensor (NaN-safe exact comparison)."""
    return t.detach().cpu().contiguous().view(torch.int16)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        where = (a != e).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((a != e).sum())} elements differ, first at {where}")
