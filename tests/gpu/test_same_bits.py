"""Same bits as the pre-restructure tree: the working tree's layer against the old tree's
(``git tag pre-restructure-57``), both imported in this process, on one GPU at EP = 1
(benchmarks/same_bits_ab.py does the comparison; its script also times both).

Needs ``DISTMOE_OLD_SRC``: the old tree's ``src`` folder, e.g.

    git archive pre-restructure-57 src | tar -x -C /tmp/old
    DISTMOE_OLD_SRC=/tmp/old/src python -m pytest -q -m gpu tests/gpu/test_same_bits.py
"""

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "same_bits_ab.py"


def _same_bits_module():
    name = "same_bits_ab"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
def test_same_bits_as_pre_restructure_tree():
    old_src = os.environ.get("DISTMOE_OLD_SRC")
    if not old_src:
        pytest.skip("DISTMOE_OLD_SRC is unset (set it to the old tree's src folder: "
                    "git archive pre-restructure-57 src | tar -x -C DIR; DIR/src)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sb = _same_bits_module()
    result = sb.run_same_bits(old_src, "qwen3-30b-a3b-t2048", "sampled", "cuda")
    bits = result["bits"]
    if bits["verdict"] == "nondeterministic in both":
        warnings.warn(f"old tree not deterministic: new-vs-old {bits['max_abs_diff']}, "
                      f"old-vs-old {bits['old_vs_old']['max_abs_diff']}", stacklevel=1)
    assert sb.passes(bits), (
        f"{bits['verdict']}: equal {bits['equal']}, max |new - old| {bits['max_abs_diff']}, "
        f"old vs old {bits['old_vs_old']}, {bits.get('bad')}")
