"""``python -m distmoe demo`` end to end on CPU ranks: a training step by default."""

import argparse
import re
import subprocess
import sys

import pytest
import torch

import distmoe
from distmoe.tools import demo


def _demo(*extra):
    cmd = [sys.executable, "-m", "distmoe", "demo", "--device", "cpu", "--ep", "2",
           "--tokens", "12", "--iters", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_demo_runs_a_training_step_and_passes():
    r = _demo()
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "training step (forward + backward)" in out
    for name in ("y", "grad_x", "grad_scores", "grad_w13", "grad_w2"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert "activation buffer:" in out and out.rstrip().endswith("PASS")


def test_demo_inference_flag():
    r = _demo("--inference")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "forward only" in r.stdout and "grad_x" not in r.stdout


# --------------------------------------------------------------------------- bad options
# In process: the CLI's run() with a parsed argument list. dm.launch is replaced by a
# function that fails the test, so every refusal is shown to come before any rank starts.


def _run_demo(monkeypatch, capsys, *argv):
    def no_launch(*args, **kwargs):
        raise AssertionError("the demo started its ranks before refusing the options")

    monkeypatch.setattr(distmoe, "launch", no_launch)
    parser = argparse.ArgumentParser(prog="distmoe demo")
    demo.add_arguments(parser)
    rc = demo.run(parser.parse_args(list(argv)))
    return rc, capsys.readouterr()


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--ep", "3"), r"--experts \(8\) must be divisible by --ep \(3\)"),
        (("--ep", "0"), r"--ep \(0\) must be >= 1"),
        (("--tokens", "0"), r"--tokens \(0\) must be >= 1"),
        (("--tokens", "-4"), r"--tokens \(-4\) must be >= 1"),
        (("--top-k", "9"), r"--top-k \(9\) must be <= --experts \(8\)"),
        (("--hidden", "0"), r"--hidden \(0\) must be >= 1"),
        (("--ffn", "0"), r"--ffn \(0\) must be >= 1"),
        (("--experts", "0"), r"--experts \(0\) must be >= 1"),
        (("--hidden", "12"), r"--hidden \(12\) must be a multiple of 8"),
        (("--iters", "0"), r"--iters \(0\) must be >= 1"),
        (("--iters", "-1"), r"--iters \(-1\) must be >= 1"),
    ],
)
def test_demo_bad_options_exit_2_before_running(argv, message, monkeypatch, capsys):
    rc, captured = _run_demo(monkeypatch, capsys, "--device", "cpu", *argv)
    assert rc == 2
    assert captured.out == ""  # not even the header line
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("distmoe demo: error: "), captured.err
    assert re.search(message, lines[0]), lines[0]
    for field in ("num_experts", "ep_size", "max_tokens", "top_k"):
        assert field not in lines[0]


def test_demo_cuda_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, captured = _run_demo(monkeypatch, capsys, "--device", "cuda", "--ep", "1")
    assert rc == 2 and captured.out == ""
    assert captured.err == (
        "distmoe demo: error: --device cuda: no CUDA device is available "
        "(torch.cuda.is_available() is False)\n"
    )


def test_demo_bad_option_through_the_cli():
    """``python -m distmoe demo --ep 3``: status 2, one line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "distmoe", "demo", "--device", "cpu", "--ep", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr == "distmoe demo: error: --experts (8) must be divisible by --ep (3)\n"
