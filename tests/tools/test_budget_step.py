"""tools/budget_step.py: argument parsing and one CPU run of the whole tool (Triton
interpreter, the smoke shape): every candidate's slot, what its layers kept and its time."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tool(load_tool):
    return load_tool("budget_step")


def test_parsing(tool):
    assert tool.parse_factors("0.6,0.75,1") == [0.6, 0.75, 1.0]
    with pytest.raises(ValueError, match=r"'a' is not a number"):
        tool.parse_factors("0.5,a")
    with pytest.raises(ValueError, match=r"1.5 is not in \[0, 1\]"):
        tool.parse_factors("1.5")
    assert tool.parse_modes("auto,rows") == ["auto", "rows"]
    with pytest.raises(ValueError,
                       match=r"subset of \['auto', 'autoip', 'rows', 'x'\], got \['y'\]"):
        tool.parse_modes("rows,y")
    assert tool.kept_letters([[0, 0, 0], [0, 1, 1], [1, 0, 1]]) == "RXI"


def test_one_run_on_the_cpu(tmp_path):
    out = tmp_path / "t.csv"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "budget_step.py"), "--shape", "smoke",
         "--layers", "3", "--factors", "0.5", "--rounds", "1", "--iters", "1", "--warmup",
         "0", "--csv", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["candidate"] for r in rows] == ["saved", "saved-auto", "rows@0.5", "x@0.5",
                                              "auto@0.5"]
    assert rows[0]["kept"] == rows[1]["kept"] == "RRR"
    assert float(rows[0]["ratio_to_saved"]) == 1.0 and rows[0]["slot_bytes"] == rows[1][
        "slot_bytes"]
    # the three modes share one slot size, smaller than the roomy one
    assert len({r["slot_bytes"] for r in rows[2:]}) == 1
    assert int(rows[2]["slot_bytes"]) < int(rows[0]["slot_bytes"])
    assert all(re.fullmatch(r"[RXI]{3}", r["kept"]) for r in rows)
    assert "X" not in rows[2]["kept"] and "R" not in rows[3]["kept"]
    assert all(float(r["ms"]) > 0 for r in rows)
    assert "kept (R rows, X x, I input)" in proc.stdout
