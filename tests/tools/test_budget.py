"""``python -m distmoe ab --budget`` (:mod:`distmoe.tools.budget`): argument parsing and one
CPU run of the whole command (Triton interpreter, the smoke shape): every candidate's slot,
what its layers kept and its time."""

import csv
import re

import pytest

from distmoe.tools import budget


def test_parsing():
    assert budget.parse_factors("0.6,0.75,1") == [0.6, 0.75, 1.0]
    with pytest.raises(ValueError, match=r"'a' is not a number"):
        budget.parse_factors("0.5,a")
    with pytest.raises(ValueError, match=r"1.5 is not in \[0, 1\]"):
        budget.parse_factors("1.5")
    assert budget.parse_modes("auto,rows") == ["auto", "rows"]
    with pytest.raises(ValueError,
                       match=r"subset of \['auto', 'autoip', 'rows', 'x'\], got \['y'\]"):
        budget.parse_modes("rows,y")
    assert budget.kept_letters([[0, 0, 0], [0, 1, 1], [1, 0, 1]]) == "RXI"


def test_bad_factors_exit_2_before_running(distmoe_cli, tmp_path):
    r = distmoe_cli("ab", "--budget", "--factors", "2", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "distmoe ab: error: --factors '2': 2.0 is not in [0, 1]"


def test_one_run_on_the_cpu(tmp_path, distmoe_cli):
    out = tmp_path / "t.csv"
    r = distmoe_cli("ab", "--budget", "--shape", "smoke", "--layers", "3", "--factors", "0.5",
                    "--rounds", "1", "--iters", "1", "--warmup", "0", "--csv", str(out),
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [r_["candidate"] for r_ in rows] == ["saved", "saved-auto", "rows@0.5", "x@0.5",
                                                "auto@0.5"]
    assert rows[0]["kept"] == rows[1]["kept"] == "RRR"
    assert float(rows[0]["ratio_to_saved"]) == 1.0
    assert rows[0]["slot_bytes"] == rows[1]["slot_bytes"]
    # the three modes share one slot size, smaller than the roomy one
    assert len({r_["slot_bytes"] for r_ in rows[2:]}) == 1
    assert int(rows[2]["slot_bytes"]) < int(rows[0]["slot_bytes"])
    assert all(re.fullmatch(r"[RXI]{3}", r_["kept"]) for r_ in rows)
    assert "X" not in rows[2]["kept"] and "R" not in rows[3]["kept"]
    assert all(float(r_["ms"]) > 0 for r_ in rows)
    assert "kept (R rows, X x, I input)" in r.stdout
    assert "say nothing about GPU speed" in r.stdout
