"""Heap self-test: every rank writes rows into every peer's buffer with a Triton kernel that
addresses the peers only through the heap's base-address table; every rank then checks
bit-exactly what it received. Used by the CPU test suite and by the GPU check script."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .heap import SymmetricHeap


@triton.jit
def _put_rows_kernel(src_ptr, bases_ptr, rank, NUM_ROWS: tl.constexpr,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per destination rank: copy src[p] ([NUM_ROWS, ROW] int32) into slot `rank`
    # of rank p's buffer, which holds [world, NUM_ROWS, ROW] int32.
    p = tl.program_id(0)
    dst = tl.load(bases_ptr + p).to(tl.pointer_type(tl.int32))
    dst += rank * NUM_ROWS * ROW
    offs = tl.arange(0, BLOCK)
    for start in tl.static_range(0, NUM_ROWS * ROW, BLOCK):
        idx = start + offs
        mask = idx < NUM_ROWS * ROW
        vals = tl.load(src_ptr + p * NUM_ROWS * ROW + idx, mask=mask)
        tl.store(dst + idx, vals, mask=mask)


def _payload(src: int, dst: int, num_rows: int, row: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * (src + 1) + dst)
    return torch.randint(-2**31, 2**31 - 1, (num_rows, row), generator=g,
                         dtype=torch.int64).to(torch.int32).to(device)


def peer_put_check(heap: SymmetricHeap, *, num_rows: int = 5, row: int = 24,
                   name: str = "selftest") -> int:
    """*Collective.* Run the all-to-all row exchange; returns the number of rows checked.
    Raises AssertionError naming the source rank whose rows arrived wrong."""
    world, rank = heap.world_size, heap.rank
    num_bytes = world * num_rows * row * 4
    heap.allocate(name, num_bytes)
    own = heap.view(name, rank, torch.int32, (world, num_rows, row))
    own.fill_(-7)  # poison: a missing write shows up
    heap.barrier()
    src = torch.stack([_payload(rank, p, num_rows, row, heap.device) for p in range(world)])
    _put_rows_kernel[(world,)](src, heap.base_table(name), rank, NUM_ROWS=num_rows, ROW=row,
                               BLOCK=128)
    heap.barrier()
    for s in range(world):
        expected = _payload(s, rank, num_rows, row, heap.device)
        if not torch.equal(own[s], expected):
            bad = int((own[s] != expected).sum())
            raise AssertionError(f"rank {rank}: {bad} values from rank {s} arrived wrong")
    heap.barrier()
    return world * num_rows
