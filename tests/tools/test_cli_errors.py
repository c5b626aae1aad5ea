"""User errors at the command line end in one line and exit status 2, not a traceback: the
GPU-only scripts on a machine without CUDA, gpu_check without a GPU, bad ``--set`` /
``--variant`` specs, unreadable input files, ``tools/ab_layer.sh`` misuse, ``./run --help``,
and a ``python -m distmoe`` command whose module cannot be imported; a closed stdout ends
quietly (status 141)."""

import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU = torch.cuda.is_available()


def _run(*cmd, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(list(cmd), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(GPU, reason="the no-GPU message needs a machine without CUDA")
@pytest.mark.parametrize("tool", ["profile_layer", "sustained_check", "tune_gemm",
                                  "tune_wgrad", "tune_combine"])
def test_gpu_only_tools_say_they_need_a_gpu(tool):
    r = _run(sys.executable, f"tools/{tool}.py")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == \
        f"{tool}.py: error: needs a CUDA GPU (torch sees none in this process)"


@pytest.mark.skipif(GPU, reason="the no-GPU exit needs a machine without CUDA")
def test_gpu_check_fails_without_a_gpu(tmp_path):
    # it used to run the suite (everything skipped) and report success
    r = _run(sys.executable, "tools/gpu_check.py", "--out", str(tmp_path))
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-1000:])
    assert "gpu_check: error: no CUDA GPU in this process" in r.stderr


@pytest.mark.parametrize("spec,message", [
    ("bogus", "expected KERNEL[:WHEN]:FIELD=VALUE"),
    ("w13:num_stages=abc", "VALUE must be an int, True / False, or a tuple of ints"),
    ("w13:nofield=3", "W13Config has no field(s) ['nofield']"),
])
def test_ab_bench_bad_set_is_one_line(spec, message):
    r = _run(sys.executable, "tools/ab_bench.py", "--set", spec, "--", "--help")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("ab_bench.py: error: ") and message in r.stderr, r.stderr


def test_ab_interleaved_refuses_zero_rounds_and_bad_variants():
    r = _run(sys.executable, "tools/ab_interleaved.py", "--rounds", "0")
    assert r.returncode == 2 and "--rounds (0) must be >= 1" in r.stderr, r.stderr[-2000:]
    r = _run(sys.executable, "tools/ab_interleaved.py", "--variant", "novalue")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("script", ["tools/trace_timeline.py", "benchmarks/replot.py"])
def test_unreadable_input_file_is_one_line(script, tmp_path):
    r = _run(sys.executable, script, str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "missing.json: not a readable" in r.stderr


def test_ab_layer_sh_checks_its_arguments(tmp_path):
    r = _run("bash", "tools/ab_layer.sh")
    assert r.returncode == 2 and r.stderr.startswith("usage: bash tools/ab_layer.sh")
    r = _run("bash", "tools/ab_layer.sh", str(tmp_path), "2")
    assert r.returncode == 2 and "holds no distmoe package" in r.stderr, r.stderr
    r = _run("bash", "tools/ab_layer.sh", "src", "x")
    assert r.returncode == 2 and "ROUNDS (x) must be a positive integer" in r.stderr, r.stderr


def test_run_script_help_needs_no_install():
    r = _run("bash", "run", "--help", timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("usage: ./run {demo|test|plan|bench}")


@pytest.mark.parametrize("cmd", [
    ["-m", "distmoe", "plan", "--tensors"],
    ["-m", "distmoe.tools.plan_cli", "--tensors"],  # the stand-alone entries: a traceback
    ["-m", "distmoe.tools.bench", "--list"],
    ["tools/time_routing.py", "--shapes", "smoke", "--tokens", "4"],
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
    from distmoe.__main__ import main

    real = builtins.__import__

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name.endswith("bench") and fromlist and "cli" in fromlist:
            raise ImportError("No module named 'tqdm'")
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    assert main(["bench", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distmoe bench: error: this command could not be imported "
                          "(ImportError: No module named 'tqdm')"), err
    with pytest.raises(SystemExit):  # an available command still refuses unknown options
        main(["plan", "--bogus"])
