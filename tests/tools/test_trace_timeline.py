"""tools/trace_timeline.py on a synthetic Chrome trace: the last of N equal steps, relative
times, CPU events left out, and a clear error when the events do not split into N steps."""

import gzip
import json


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


def test_last_step_of_a_trace(tmp_path, capsys, load_tool):
    mod = load_tool("trace_timeline")
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(3), f)
    assert mod.main([str(path), "--steps", "3"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln and not ln.startswith("#")]
    assert [ln.split()[-1] for ln in lines] == ["Device)", "w13_step2", "w2"]
    assert lines[0].split()[:3] == ["0.0", "48.0", "s146"]
    assert lines[1].split()[:3] == ["8.0", "300.5", "s7"]
    assert lines[2].split()[:2] == ["318.0", "200.0"]


def test_steps_must_split_the_trace(tmp_path, capsys, load_tool):
    mod = load_tool("trace_timeline")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace(3)))
    assert mod.main([str(path), "--steps", "2"]) == 1
    assert "9 GPU events do not split into 2 equal steps" in capsys.readouterr().err
