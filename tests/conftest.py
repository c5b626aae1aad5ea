"""Test setup shared by the whole suite.

* Without CUDA, Triton kernels run through the interpreter; importing distmoe selects it and
  corrects Triton 3.6's interpreter bf16 ``tl.dot`` (distmoe.kernels.base.interpreter).
* Every test starts from a fixed seed (reproducible, yet each test draws its own data).
* ``gpu`` / ``multigpu`` tests skip without enough CUDA devices.
* After the session, no distmoe segment may remain in /dev/shm.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import distmoe  # noqa: F401  (selects the interpreter before kernel modules import)
from distmoe.kernels.base.interpreter import interpreter_active, patch_interpreter_bf16_dot

if interpreter_active():
    patch_interpreter_bf16_dot()


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = _num_gpus()
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n}"))
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _seed(request):
    seed = zlib.crc32(request.node.nodeid.encode())  # stable across processes and runs
    torch.manual_seed(seed)
    yield


def _distmoe_segments() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("distmoe"))
    except OSError:
        return []


@pytest.fixture(scope="session", autouse=True)
def _no_shm_leftovers():
    before = set(_distmoe_segments())
    yield
    left = sorted(set(_distmoe_segments()) - before)
    assert not left, f"segments left in /dev/shm after the suite: {left}"
