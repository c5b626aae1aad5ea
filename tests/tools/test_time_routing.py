"""tools/time_routing.py runs end to end on CPU (a smoke run: every implementation is checked
against the torch construction before it is timed)."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "time_routing.py"


def test_time_routing_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("time_routing", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "routing.csv"
    assert mod.main(["--shapes", "smoke", "--tokens", "8", "--ep", "2", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "smoke run, times are not measurements" in text
    lines = out.read_text().splitlines()
    assert lines[0].startswith("shape,tokens,ep,routes,experts,impl,ms")
    assert {line.split(",")[5] for line in lines[1:]} == {"torch", "fused", "blocked"}
