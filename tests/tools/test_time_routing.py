"""tools/time_routing.py runs end to end on CPU (a smoke run: every implementation is checked
against the torch construction before it is timed); bad options end in one error line, status
2, before any work."""

import pytest


def test_time_routing_smoke(tmp_path, capsys, load_tool):
    mod = load_tool("time_routing")
    out = tmp_path / "routing.csv"
    assert mod.main(["--shapes", "smoke", "--tokens", "8", "--ep", "2", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "smoke run, times are not measurements" in text
    lines = out.read_text().splitlines()
    assert lines[0].startswith("shape,tokens,ep,routes,experts,impl,ms")
    assert {line.split(",")[5] for line in lines[1:]} == {"torch", "fused", "blocked"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--ep", "0"], "--ep (0) must be >= 1"),  # was status 1, no prog name
    (["--tokens", "8", "0"], "--tokens values (8 0) must be >= 1"),  # likewise
    (["--ep", "3", "--shapes", "smoke"],  # 3 divides no shape's E: nothing to time
     "--ep 3 divides the expert count of none of the shapes (smoke: E=8)"),
])
def test_time_routing_option_errors(argv, message, capsys, load_tool):
    mod = load_tool("time_routing")
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # before any work
    assert err.splitlines()[-1].endswith(f": error: {message}"), err
