"""``python -m distmoe tune`` (:mod:`distmoe.tools.tune`): the candidate lists (the plan's
config first, the config class's all_configs(), the Gluon configs on Hopper classes only),
every kernel's case on the CPU (the plan's config writes finite outputs), and one sweep of the
command in Triton's interpreter with the note that its times are the CPU's."""

import argparse
import csv
import math

import pytest
import torch

from distmoe.kernels.movement.combine import CombineConfig
from distmoe.kernels.w13_forward.config import W13Config
from distmoe.tools import tune
from distmoe.tools.bench.workloads import SHAPES


def test_candidates_start_with_the_plan():
    shape = SHAPES["dense-e32"]
    for kernel in tune.KERNELS:
        for dc in ("h100", "generic"):
            cands = tune.candidates(kernel, shape, dc)
            assert cands[0] == tune.plan_config(kernel, shape, dc), (kernel, dc)
            assert len(cands) == len({repr(c) for c in cands})  # no repeats
            gluon = [c for c in cands[1:] if getattr(c, "gluon", False)]
            assert bool(gluon) == (dc == "h100" and kernel != "combine"), (kernel, dc)
    # the plan: the Gluon W13 on a Hopper class at dense-e32, the Triton one on generic
    assert tune.plan_config("w13", shape, "h100").gluon
    assert not tune.plan_config("w13", shape, "generic").gluon
    assert tune.plan_config("w13_train", shape, "generic") != \
        tune.plan_config("w13", shape, "generic")
    triton = tune.candidates("w13", shape, "generic")
    assert set(W13Config.all_configs()) <= set(triton)
    combine = tune.candidates("combine", shape, "generic")
    assert combine[1:] == [c for c in CombineConfig.all_configs() if c != combine[0]]
    assert len(tune.candidates("w2", shape, "h100", max_candidates=3)) == 4


def test_describe_names_the_fields_set():
    text = tune.describe(CombineConfig(block_t=2, block_d=512, num_warps=4))
    assert "block_t=2" in text and "block_d=512" in text


@pytest.mark.parametrize("kernel", [k for k in tune.KERNELS if k != "combine"])
def test_every_case_runs_the_plans_config_on_the_cpu(kernel):
    if torch.cuda.is_available():
        pytest.skip("the interpreter case is for a machine without CUDA")
    shape = SHAPES["smoke"]
    case = tune.make_case(kernel, shape, torch.device("cpu"))
    case.out.fill_(case.poison)
    case.run(tune.plan_config(kernel, shape, "generic"))
    assert torch.isfinite(case.out.float()).all() and case.out.float().abs().max() > 0
    assert case.work > 0 and case.unit == "TFLOP/s"


def test_a_sweep_on_the_cpu(tmp_path, capsys):
    """The combine's sweep, two candidates besides the plan's and the copy: every output
    checked against the plan's (err 0: the same sum), the plan marked, a CSV row each."""
    out = tmp_path / "tune.csv"
    args = tune.add_arguments(argparse.ArgumentParser()).parse_args(
        ["combine", "--shapes", "smoke", "--max-candidates", "2", "--rounds", "1", "--iters",
         "1", "--csv", str(out)])
    assert tune.run(args) == 0
    printed = capsys.readouterr().out
    assert "smoke combine: T=64 D=64 F=32 E=8 K=2" in printed
    assert "3 configs timed" in printed and " PLAN " in printed and "REFERENCE copy" in printed
    if not torch.cuda.is_available():
        assert printed.rstrip().splitlines()[-1].startswith("note: these are CPU times")
    rows = list(csv.DictReader(out.open()))
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "reference"]
    assert rows[0]["plan"] == "True" and all(float(r["err"]) == 0 for r in rows[:3])
    assert all(float(r["ms"]) > 0 and math.isfinite(float(r["rate"])) for r in rows)


def test_option_errors(capsys):
    args = tune.add_arguments(argparse.ArgumentParser()).parse_args(["w13", "--rounds", "0"])
    assert tune.run(args) == 2
    assert capsys.readouterr().err == "distmoe tune: error: --rounds (0) must be >= 1\n"
    with pytest.raises(SystemExit):
        tune.add_arguments(argparse.ArgumentParser()).parse_args(["w14"])
