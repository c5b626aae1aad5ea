"""Symmetric heap on CPU ranks: peer writes through a Triton kernel, bit-exact checks,
segments never left in /dev/shm (also when a rank raises)."""

import os

import pytest
import torch

import distmoe
from distmoe.runtime import create_heap
from distmoe.runtime.selftest import peer_put_check


def _exchange(rank, world):
    heap = create_heap(backend="cpu")
    try:
        checked = peer_put_check(heap)
        table = heap.base_table("selftest")
        assert table.dtype == torch.int64 and table.shape == (world,)
        assert int(table[rank]) == heap.local("selftest").data_ptr()
        return checked
    finally:
        heap.close()


def _segments():
    return [n for n in os.listdir("/dev/shm") if n.startswith("distmoe")]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_peer_writes_arrive_bit_exact(world):
    # each rank writes 5 rows of 24 int32 into every peer through the base-address table
    assert distmoe.launch(_exchange, world) == [world * 5] * world


def _segments_after_allocate(rank, world):
    heap = create_heap(backend="cpu")
    heap.allocate("a", 1000)
    heap.allocate("b", 3)
    names = [n for n in os.listdir("/dev/shm") if n.startswith(os.environ["DISTMOE_SHM_PREFIX"])]
    heap.close()
    heap.close()  # idempotent
    try:
        heap.local("a")
    except RuntimeError as exc:
        return names, str(exc)
    return names, None


def test_segments_are_unlinked_once_mapped_and_close_is_idempotent():
    results = distmoe.launch(_segments_after_allocate, 2)
    for names, err in results:
        assert names == []
        assert "closed" in err


def _raise_after_allocate(rank, world):
    heap = create_heap(backend="cpu")
    heap.allocate("x", 4096)
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    heap.barrier()  # rank 0 waits here until the launcher stops it
    return rank


def test_failing_rank_leaves_no_segment():
    before = set(_segments())
    with pytest.raises(ValueError, match="rank 1 fails on purpose"):
        distmoe.launch(_raise_after_allocate, 2, timeout=60)
    assert set(_segments()) <= before


def _mismatched_sizes(rank, world):
    heap = create_heap(backend="cpu")
    try:
        heap.allocate("x", 256 * (rank + 1))
    finally:
        heap.close()


def test_allocation_sizes_must_agree():
    with pytest.raises(ValueError, match=r"different names or sizes across ranks"):
        distmoe.launch(_mismatched_sizes, 2, timeout=60)


def _bad_allocations(rank, world):
    heap = create_heap(backend="cpu")
    msgs = []
    for args in (("", 8), ("y", 0)):
        try:
            heap.allocate(*args)
        except ValueError as exc:
            msgs.append(str(exc))
    heap.allocate("y", 8)
    try:
        heap.allocate("y", 8)
    except ValueError as exc:
        msgs.append(str(exc))
    heap.close()
    return msgs


def test_bad_allocations_name_the_argument():
    msgs = distmoe.launch(_bad_allocations, 1)[0]
    assert "name ('') must be a non-empty string" in msgs[0]
    assert "num_bytes (0) must be a positive int" in msgs[1]
    assert "buffer name ('y') is already allocated" in msgs[2]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_heap_ranks_sharing_one_gpu(world):
    # EP=1 uses symmetric memory; several ranks on one GPU use the CUDA IPC backend.
    assert distmoe.launch(_gpu_exchange, world, device="cuda", gpus=[0], timeout=240) == \
        [world * 5] * world


@pytest.mark.multigpu
def test_gpu_heap_two_gpus_symmetric_memory():
    assert distmoe.launch(_gpu_exchange, 2, device="cuda", gpus=[0, 1], timeout=240,
                          args=("cuda_symm",)) == [10, 10]


def _gpu_exchange(rank, world, backend="auto"):
    heap = create_heap(backend=backend)
    expected = "cuda_symm" if world == 1 or backend == "cuda_symm" else "cuda_ipc"
    assert heap.backend == expected, (heap.backend, expected)
    try:
        # what torch's allocator does not count (the benchmark adds it to its peak memory)
        before = torch.cuda.memory_allocated()
        heap.allocate("accounting", 1 << 20)
        grew = torch.cuda.memory_allocated() - before
        if expected == "cuda_symm":
            assert heap.untracked_bytes == sum(heap.size(n) for n in heap.names) >= 1 << 20
            assert grew < 1 << 20, grew
        else:
            assert heap.untracked_bytes == 0 and grew >= 1 << 20, grew
        return peer_put_check(heap)
    finally:
        heap.close()


def _use_after_close(rank, world):
    heap = create_heap(backend="cpu")
    heap.allocate("x", 4096)
    t = heap.local("x")
    t.fill_(3)
    heap.close()
    # the tensor keeps its mapping: reading and writing it after close used to be a
    # segmentation fault (mmap.close unmapped it under the tensor)
    before = int(t.sum())
    t.fill_(1)
    return before, int(t.sum())


def test_a_tensor_outlives_its_heap_close():
    assert distmoe.launch(_use_after_close, 1, timeout=120) == [(3 * 4096, 4096)]
