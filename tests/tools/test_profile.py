"""``python -m distmoe profile`` (:mod:`distmoe.tools.profile`): the last step of a Chrome
trace as a timeline (relative times, CPU events left out, a clear error when the events do
not split into N steps), one layer step profiled on the CPU (Triton interpreter, with a plan
override), and option errors in one line."""

import argparse
import gzip
import json

import pytest

from distmoe.tools import profile


def _args(*argv):
    return profile.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def _trace(steps):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 5, "tid": 1}]
    for s in range(steps):
        t = 1000.0 * s
        events += [
            {"ph": "X", "cat": "kernel", "name": f"w13_step{s}", "ts": t + 10, "dur": 300.5,
             "tid": 7},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)",
             "ts": t + 2, "dur": 48.0, "tid": 146},
            {"ph": "X", "cat": "kernel", "name": "w2", "ts": t + 320, "dur": 200.0, "tid": 7},
        ]
    return {"traceEvents": events}


def test_last_step_of_a_trace(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(3), f)
    assert profile.run(_args("--timeline", str(path), "--steps", "3")) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln and not ln.startswith("#")]
    assert [ln.split()[-1] for ln in lines] == ["Device)", "w13_step2", "w2"]
    assert lines[0].split()[:3] == ["0.0", "48.0", "s146"]
    assert lines[1].split()[:3] == ["8.0", "300.5", "s7"]
    assert lines[2].split()[:2] == ["318.0", "200.0"]


def test_steps_must_split_the_trace(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace(3)))
    assert profile.run(_args("--timeline", str(path), "--steps", "2")) == 1
    assert "9 GPU events do not split into 2 equal steps" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"steps \(0\) must be >= 1"):
        profile.last_step(_trace(1)["traceEvents"], 0)


def test_unreadable_trace_is_one_line(tmp_path, capsys):
    assert profile.run(_args("--timeline", str(tmp_path / "missing.json"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("distmoe profile: error: --timeline ") and err.count("\n") == 1
    assert "missing.json: not a readable Chrome trace" in err


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps (0) must be >= 1"),
    (["--tokens", "0"], "--tokens (0) must be >= 1"),
    (["--set", "w13:bogus=1"], "unknown field(s) bogus of W13Config"),
    (["--set", "input:buffer=True"], "--set input:buffer=True is for inference"),
])
def test_layer_option_errors(argv, message, capsys):
    assert profile.run(_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("distmoe profile: error: ") and message in err


def test_views_are_exclusive():
    with pytest.raises(SystemExit):
        _args("--timeline", "t.json", "--ptxas")


def test_one_layer_step_on_the_cpu(tmp_path, distmoe_cli):
    """The smoke shape's forward under torch.profiler on the CPU, a plan override set: the
    plan printed (the override marked), a table of CPU operators, the interpreter note and
    a Chrome trace."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU view needs a machine without CUDA")
    trace = tmp_path / "t.json"
    r = distmoe_cli("profile", "--shape", "smoke", "--tokens", "16", "--mode", "fwd",
                    "--steps", "1", "--rows", "3", "--set", "w13:num_stages=3", "--trace",
                    str(trace), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "set: w13:num_stages=3"
    assert "w13        Triton W13 (override)" in r.stdout
    start = lines.index("smoke fwd: T=16 D=64 F=32 E=8 K=2, EP=1, CPU (Triton interpreter)")
    assert lines[start + 1].split()[-4:] == ["CPU", "operator", "(self", "time)"]
    assert len(lines) == start + 2 + 3 + 2  # header, 3 rows, the sum, the note
    assert "sum of CPU operator (self time) time per step" in lines[-2]
    assert lines[-1].startswith("note: ") and "say nothing about GPU speed" in lines[-1]
    assert json.loads(trace.read_text())["traceEvents"]
