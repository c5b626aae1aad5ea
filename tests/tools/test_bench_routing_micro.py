"""``python -m distmoe bench --routing-micro`` (:mod:`distmoe.tools.bench.routing_micro`) runs
end to end on the CPU (a smoke run: every implementation is checked against the torch
construction before it is timed); bad options end in one error line, status 2, before any
work."""

import pytest

from distmoe.tools.bench import cli


def test_routing_micro_smoke(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main(["--routing-micro", "--device", "cpu", "--shapes", "smoke", "--tokens", "8",
                     "--routing-ep", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "routing tables of rank 0, CPU (Triton interpreter)" in text
    assert "say nothing about GPU speed" in text
    lines = (out / "routing_tables.csv").read_text().splitlines()
    assert lines[0].startswith("shape,tokens,ep,routes,experts,impl,ms")
    assert {line.split(",")[5] for line in lines[1:]} == {"torch", "fused", "blocked"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--routing-ep", "0"], "--routing-ep (0) must be >= 1"),
    (["--tokens", "8", "0"], "--tokens values (8 0) must be >= 1"),
    (["--routing-ep", "3", "--shapes", "smoke"],  # 3 divides no shape's E: nothing to time
     "--routing-ep 3 divides the expert count of none of the shapes (smoke: E=8)"),
])
def test_routing_micro_option_errors(argv, message, capsys):
    assert cli.main(["--routing-micro", "--device", "cpu", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # before any work
    assert err == f"distmoe bench: error: {message}\n"


def test_routing_ep_needs_routing_micro(capsys):
    assert cli.main(["--routing-ep", "2"]) == 2
    assert capsys.readouterr().err == \
        "distmoe bench: error: --routing-ep (2) needs --routing-micro\n"
