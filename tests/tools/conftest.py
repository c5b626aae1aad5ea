"""Shared by the tests of ``python -m distmoe``'s commands (:mod:`distmoe.tools`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_distmoe(*args: str, nproc: int | None = None, cwd=None, timeout: float = 600,
                **env: str) -> subprocess.CompletedProcess:
    """``python -m distmoe ARGS`` in a subprocess (this checkout's ``src``; kernels in
    Triton's interpreter where there is no GPU), or under ``torch.distributed.run`` with
    ``nproc`` ranks; output captured as text."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env)
    launch = ([] if nproc is None else
              ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"])
    return subprocess.run([sys.executable, *launch, "-m", "distmoe", *args], cwd=cwd or ROOT,
                          env=environ, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def distmoe_cli():
    """:func:`run_distmoe`."""
    return run_distmoe
