"""User errors at the command line end in one line and exit status 2, not a traceback: a
GPU-only option on a machine without CUDA, bad ``--variant`` specs, unreadable input files,
``./run --help``, and a ``python -m distmoe`` command whose module cannot be imported; a
closed stdout ends quietly (status 141)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU = torch.cuda.is_available()


@pytest.mark.skipif(GPU, reason="the no-GPU message needs a machine without CUDA")
def test_graph_profile_says_it_needs_a_gpu(distmoe_cli):
    r = distmoe_cli("profile", "--shape", "smoke", "--graph")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == \
        "distmoe profile: error: --graph needs a CUDA GPU (a CUDA graph of the step)"


@pytest.mark.parametrize("variant,message", [
    ("bogus", "expected NAME=SPEC[+SPEC...]"),
    ("v=bogus", "expected KERNEL:FIELD=VALUE"),
    ("v=w13:num_stages=abc", "'abc' is not a VALUE: an int, True / False, None"),
    ("v=w13:nofield=3", "unknown field(s) nofield of W13Config (w13)"),
])
def test_ab_bad_variant_is_one_line(variant, message, distmoe_cli):
    r = distmoe_cli("ab", "--variant", variant)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("distmoe ab: error: ") and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""


def test_ab_refuses_zero_rounds(distmoe_cli):
    r = distmoe_cli("ab", "--rounds", "0")
    assert r.returncode == 2 and r.stderr == "distmoe ab: error: --rounds (0) must be >= 1\n"


@pytest.mark.parametrize("argv", [["profile", "--timeline"], ["bench", "--replot"],
                                  ["profile", "--ncu"]])
def test_unreadable_input_file_is_one_line(argv, tmp_path, distmoe_cli):
    r = distmoe_cli(*argv, str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "missing.json" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_run_script_help_needs_no_install():
    r = subprocess.run(["bash", "run", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0
    assert r.stdout.startswith("usage: ./run {demo|test|plan|bench|ab|profile|tune|scaling}")


@pytest.mark.parametrize("cmd", [
    ["-m", "distmoe", "plan", "--tensors"],
    ["-m", "distmoe", "plan", "--kernels"],
    ["-m", "distmoe.tools.plan_cli", "--tensors"],  # the stand-alone entries: a traceback
    ["-m", "distmoe.tools.bench", "--list"],
    ["-m", "distmoe", "bench", "--routing-micro", "--device", "cpu", "--tokens", "4"],
])
def test_closed_stdout_ends_quietly_with_status_141(cmd):
    # `... | head -1` with the reader gone before the first write: no traceback, no
    # "Exception ignored" at exit; 141 = 128 + SIGPIPE, as the shell reports for a Unix tool
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        r = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, ""), (r.returncode, r.stderr[-2000:])


def test_a_command_that_cannot_be_imported_says_why(monkeypatch, capsys):
    # an optional dependency missing: the command stays listed and says what failed, instead
    # of vanishing from argparse's choices
    import distmoe.__main__ as entry

    real = entry.importlib.import_module

    def fake_import(name, package=None):
        if name == ".tools.bench.cli":
            raise ImportError("No module named 'tqdm'")
        return real(name, package)

    monkeypatch.setattr(entry.importlib, "import_module", fake_import)
    assert entry.main(["bench", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distmoe bench: error: this command could not be imported "
                          "(ImportError: No module named 'tqdm')"), err
    with pytest.raises(SystemExit):  # an available command still refuses unknown options
        entry.main(["plan", "--bogus"])
