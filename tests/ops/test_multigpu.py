"""One rank per GPU on every visible GPU (2, 4 or 8 H200s; skipped with fewer than two):
the heap, the forward on every routing case, training (saving and replaying) and a CUDA-graph
training step. These are issue 8's correctness runs; on one GPU the same code runs with ranks
sharing it (test_forward_gpu.py, test_training_gpu.py)."""

import pytest
import torch
from forward_cases import CASES, check_against_reference, forward_cases_rank
from test_training import check_training
from test_training_gpu import _graph_step_rank

import distmoe as dm
from distmoe.runtime import create_heap
from distmoe.runtime.selftest import peer_put_check


def _gpus():
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _heap_rank(rank, world):
    heap = create_heap()
    try:
        return heap.backend, peer_put_check(heap)
    finally:
        heap.close()


@pytest.mark.multigpu
def test_heap_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_heap_rank, len(gpus), device="cuda", gpus=gpus, timeout=300)
    assert [o[1] for o in out] == [out[0][1]] * len(gpus)


@pytest.mark.multigpu
def test_forward_one_rank_per_gpu():
    gpus = _gpus()
    EP, T, D, F, E, K = len(gpus), 200, 256, 128, 8 * len(gpus), 4
    names = sorted(CASES)
    per_rank = dm.launch(forward_cases_rank, EP, device="cuda", gpus=gpus, timeout=600,
                         args=(91 + EP, T, D, F, E, K, names, "cuda"))
    for i, name in enumerate(names):
        check_against_reference([r[i] for r in per_rank], 91 + EP, EP, T, D, F, E, K, name)


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["save", "replay"])
def test_training_one_rank_per_gpu(mode):
    gpus = _gpus()
    check_training(len(gpus), mode, "cuda", gpus=gpus)


@pytest.mark.multigpu
def test_cuda_graph_training_step_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_graph_step_rank, len(gpus), device="cuda", gpus=gpus, timeout=600)
    for results, depth in out:
        assert depth == [0]
        for same, replayed_flags, eager_flags in results:
            assert same and replayed_flags == eager_flags
