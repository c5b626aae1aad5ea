"""``python -m distmoe demo`` end to end on CPU ranks: a training step by default."""

import subprocess
import sys


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
