"""tools/time_routing.py runs end to end on CPU (a smoke run: every implementation is checked
against the torch construction before it is timed)."""


def test_time_routing_smoke(tmp_path, capsys, load_tool):
    mod = load_tool("time_routing")
    out = tmp_path / "routing.csv"
    assert mod.main(["--shapes", "smoke", "--tokens", "8", "--ep", "2", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "smoke run, times are not measurements" in text
    lines = out.read_text().splitlines()
    assert lines[0].startswith("shape,tokens,ep,routes,experts,impl,ms")
    assert {line.split(",")[5] for line in lines[1:]} == {"torch", "fused", "blocked"}
