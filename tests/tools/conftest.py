"""Shared by the tests of the scripts under ``tools/`` (not a package: each is loaded from its
file)."""

import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def load_tool():
    """``load_tool(name)``: the module of ``tools/<name>.py``, freshly executed. Scripts that
    import a sibling (``ab_interleaved`` imports ``ab_bench``) put ``tools/`` on sys.path;
    this undoes that afterwards."""
    path_before = list(sys.path)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    yield load
    sys.path[:] = path_before
