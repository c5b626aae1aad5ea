"""``distmoe plan`` command line: parsed arguments in, table / JSON / PNG out."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distmoe.config import MoEConfig
from distmoe.memory import plan_memory
from distmoe.tools import plan_cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="distmoe plan")
    plan_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


WORKED = (
    "--hidden",
    "256",
    "--ffn",
    "256",
    "--experts",
    "4",
    "--top-k",
    "2",
    "--tokens",
    "2",
    "--ep",
    "2",
)


def test_defaults_show_an_example(capsys):
    assert plan_cli.run(parse()) == 0
    out = capsys.readouterr().out
    assert "bf16 training, EP 8, T 4096, D 2048, F 768, E 128 (16 per rank), K 8" in out
    assert "slot 0 (4 layers)" in out
    assert "Save/replay decisions (4 layers, 8 ranks" in out
    cfg = MoEConfig(
        hidden=2048, ffn=768, num_experts=128, top_k=8, max_tokens=4096, max_layers_per_slot=4
    )
    assert f"{plan_memory(cfg, 8).activation_buffer_bytes:,}" in out


def test_drop_route_outputs(capsys):
    """--drop-route-outputs: the full state loses the h3 routes (T*K*D*2 = 128 MiB per layer
    at T=4096, K=8, D=2048: 352 -> 224 MiB balanced), and the plan says so in bytes."""
    assert plan_cli.run(parse("--drop-route-outputs", "--tensors")) == 0
    out = capsys.readouterr().out
    cfg = MoEConfig(hidden=2048, ffn=768, num_experts=128, top_k=8, max_tokens=4096,
                    max_layers_per_slot=4, save_route_outputs=False)
    lean = plan_memory(cfg, 8)
    assert f"{lean.activation_buffer_bytes:,}" in out
    assert "full state                    234,881,024 (224.00 MiB)" in out
    assert "h3_routes" not in out


def test_regather_rows(capsys):
    """--regather-rows: the full state keeps x [T, D] instead of the gathered rows (at EP=8,
    T=4096, K=8: 4096 rows of 2048 instead of 32,768 balanced), and the plan says so."""
    assert plan_cli.run(parse("--regather-rows", "--tensors")) == 0
    out = capsys.readouterr().out
    cfg = MoEConfig(hidden=2048, ffn=768, num_experts=128, top_k=8, max_tokens=4096,
                    max_layers_per_slot=4, save_gathered_rows=False)
    assert f"{plan_memory(cfg, 8).activation_buffer_bytes:,}" in out
    assert "x_gathered" not in out.split("full state")[1]


def test_rows_json_worked_example(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"received_rows": [[4, 4], [4, 4], [5, 3], [5, 3]]}))
    out_json = tmp_path / "plan.json"
    args = parse(
        *WORKED,
        "--activation-bytes",
        "28672",
        "--rows-json",
        str(rows),
        "--json",
        str(out_json),
        "--tensors",
    )
    assert plan_cli.run(args) == 0
    text = capsys.readouterr().out
    assert "slot 0 (4 layers)" in text  # layers per slot taken from the file
    assert "Per-layer tensors at R = 4" in text and "h3_routes" in text
    data = json.loads(out_json.read_text())
    assert data["saves"]["decisions"] == [True, True, True, False]
    assert data["saves"]["required_bytes"] == [11264, 18432, 27136, 35840]
    assert data["slot_capacity_bytes"] == 28672
    assert data["activation_buffer_bytes"] == 28672 + 24576


def test_png_is_written(tmp_path):
    png = tmp_path / "plan.png"
    args = parse(
        "--precision", "mxfp8", "--total-scratch-factor", "4", "--slots", "2", "--png", str(png)
    )
    assert plan_cli.run(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inference_png(tmp_path, capsys):
    png = tmp_path / "inference.png"
    assert plan_cli.run(parse("--precision", "nvfp4", "--inference", "--png", str(png))) == 0
    out = capsys.readouterr().out
    assert "nvfp4 inference" in out and "Save/replay" not in out
    assert png.stat().st_size > 0


def test_demo_rows_are_valid():
    cfg = MoEConfig(
        hidden=2048, ffn=768, num_experts=128, top_k=8, max_tokens=4096, max_layers_per_slot=5
    )
    rows = plan_cli.demo_rows(cfg, 8, [1.0, 1.5, 3.0])
    assert len(rows) == 5 and all(len(layer) == 8 for layer in rows)
    assert all(sum(layer) == 8 * 32768 for layer in rows)
    assert rows[1][1] == 49152  # layer 1: rank 1 is hot at 1.5 x T*K
    assert rows[2][2] == cfg.receive_bound(8)  # 3 x T*K clipped to the receive bound
    assert rows[0] == [32768] * 8


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--activation-bytes", "1000"), r"--activation-bytes \(1000\) must be >= the inputs-only"),
        (("--ep", "3"), r"--experts \(128\) must be divisible by --ep \(3\)"),
        (("--hidden", "0"), r"--hidden \(0\) must be >= 1"),
        (("--imbalance", "a,b"), r"--imbalance \('a,b'\) must be comma-separated numbers"),
        (("--layers-per-slot", "0"), r"--layers-per-slot \(0\) must be >= 1"),
        # the library's field names are rewritten to the options the user typed
        (("--tokens", "-1"), r"error: --tokens \(-1\) must be >= 1$"),
        (("--experts", "0"), r"error: --experts \(0\) must be >= 1$"),
        (("--ep", "0"), r"error: --ep \(0\) must be >= 1$"),
        (("--slots", "0"), r"error: --slots \(0\) must be >= 1$"),
        (("--top-k", "200"), r"error: --top-k \(200\) must be <= --experts \(128\)$"),
        (("--hidden", "12"), r"error: --hidden \(12\) must be a multiple of 8 for --precision"),
        (("--row-block", "100"), r"error: --row-block \(100\) must be a power of two"),
        (("--activation-factor", "nan"), r"error: --activation-factor \(nan\) must be finite"),
        (
            ("--total-scratch-factor", "1"),
            r"error: --total-scratch-factor \(1.0\) must be >= --device-scratch-factor \(2.0\)",
        ),
        (("--precision", "nvfp4"), r"error: --precision nvfp4 is inference only: add --inference$"),
        (("--imbalance", "nan"), r"--imbalance \('nan'\) values must be finite and >= 0"),
        (("--imbalance", "1,inf"), r"--imbalance \('1,inf'\) values must be finite and >= 0"),
    ],
)
def test_bad_input_exits_2(argv, message, capsys):
    assert plan_cli.run(parse(*argv)) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "distmoe plan: error:" in err
    assert re.search(message, err.rstrip("\n"), re.M), err
    assert err.count("\n") == 1 and not captured.out  # one line, before any table
    for field in ("max_tokens", "num_experts", "ep_size", "num_slots", "max_layers_per_slot"):
        assert field not in err


def test_rows_above_bound_exit_2(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    rows.write_text("[[9, 0]]")
    assert plan_cli.run(parse(*WORKED, "--rows-json", str(rows))) == 2
    assert "must be <= the receive bound (8 rows)" in capsys.readouterr().err


# --------------------------------------------------------------------------- review fixes
def _worked_rows(tmp_path: Path) -> Path:
    rows = tmp_path / "worked.json"
    rows.write_text("[[4,4],[4,4],[5,3],[5,3]]")
    return rows


def _refused(capsys, *argv: str) -> str:
    """Run; expect status 2, nothing on stdout and one error line; return that line."""
    assert plan_cli.run(parse(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("distmoe plan: error: "), captured.err
    return lines[0]


def test_output_paths_checked_before_computing(tmp_path, capsys):
    err = _refused(capsys, "--json", str(tmp_path / "no" / "dir" / "x.json"))
    assert f"--json {tmp_path / 'no' / 'dir' / 'x.json'}: directory" in err
    assert "does not exist" in err
    err = _refused(capsys, "--json", str(tmp_path))
    assert f"--json {tmp_path}: is a directory" in err
    err = _refused(capsys, "--png", str(tmp_path / "missing" / "x.png"))
    assert "--png" in err and "does not exist" in err
    err = _refused(capsys, "--png", str(tmp_path))
    assert "--png" in err and "is a directory" in err
    afile = tmp_path / "file"
    afile.write_text("")
    err = _refused(capsys, "--json", str(afile / "x.json"))
    assert "--json" in err and "is not a directory" in err


def test_png_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    err = _refused(capsys, "--png", str(tmp_path / "plan.png"))
    assert "--png needs matplotlib" in err and "distmoe[tools]" in err
    assert not (tmp_path / "plan.png").exists()
    extras = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^tools = \[.*"matplotlib', extras, re.M)  # the extra the message names


def test_rows_json_read_errors_name_option_and_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    err = _refused(capsys, *WORKED, "--rows-json", str(bad))
    assert f"--rows-json {bad}: not valid JSON: Expecting value: line 1 column 1" in err
    missing = tmp_path / "missing.json"
    err = _refused(capsys, *WORKED, "--rows-json", str(missing))
    assert f"--rows-json {missing}: cannot read it" in err
    wrong_ep = tmp_path / "three.json"
    wrong_ep.write_text("[[1, 1, 1]]")
    err = _refused(capsys, *WORKED, "--rows-json", str(wrong_ep))
    assert f"--rows-json {wrong_ep}: received_rows[0] (3 ranks)" in err and "--ep (2)" in err
    rows = _worked_rows(tmp_path)
    err = _refused(capsys, *WORKED, "--rows-json", str(rows), "--layers-per-slot", "3")
    assert f"--rows-json {rows}: received_rows (4 layers)" in err
    assert "at most --layers-per-slot (3) layers" in err


def test_rows_above_bound_name_options(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    rows.write_text("[[9, 0]]")
    err = _refused(capsys, *WORKED, "--rows-json", str(rows))
    assert f"--rows-json {rows}: received_rows[0][0] (9)" in err
    assert "raise --device-scratch-factor or --total-scratch-factor" in err


def test_training_only_options_refused_with_inference(tmp_path, capsys):
    rows = _worked_rows(tmp_path)
    err = _refused(
        capsys,
        *WORKED,
        "--inference",
        "--rows-json",
        str(rows),
        "--activation-bytes",
        "28672",
        "--slots",
        "3",
        "--drop-route-outputs",
    )
    for given in (f"--rows-json {rows}", "--activation-bytes 28672", "--slots 3",
                  "--drop-route-outputs"):
        assert given in err
    assert "no effect with --inference" in err
    for argv in (
        ("--activation-factor", "2"),
        ("--layers-per-slot", "2"),
        ("--imbalance", "2"),
        ("--slots", "1"),  # given explicitly, even at its default value
    ):
        err = _refused(capsys, "--inference", *argv)
        assert f"{argv[0]} {argv[1]}" in err and "--inference" in err
    # the options that do apply to inference still work
    assert plan_cli.run(parse("--inference", "--total-scratch-factor", "3", "--tensors")) == 0


def test_imbalance_refused_with_rows_json(tmp_path, capsys):
    rows = _worked_rows(tmp_path)
    err = _refused(capsys, *WORKED, "--rows-json", str(rows), "--imbalance", "2")
    assert "--imbalance ('2') has no effect with --rows-json" in err


def test_imbalance_capped_at_receive_bound_notes_it(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert plan_cli.run(parse("--imbalance", "100", "--json", str(out_json))) == 0
    captured = capsys.readouterr()
    notes = captured.err.splitlines()
    assert notes == [
        "distmoe plan: note: --imbalance 100 x T*K: above the receive bound (65,536 rows = "
        "2 x T*K), so the hot rank of L0, L1, L2, L3 receives 65,536 rows (capped)"
    ]
    rows = json.loads(out_json.read_text())["saves"]["received_rows"]
    assert [max(layer) for layer in rows] == [65536] * 4
    # the default imbalance (at most 1.75) is below the default bound: no note
    assert plan_cli.run(parse()) == 0
    assert capsys.readouterr().err == ""
    # a lower bound caps the default's 1.75 in L3
    assert plan_cli.run(parse("--device-scratch-factor", "1.5")) == 0
    err = capsys.readouterr().err
    assert "--imbalance (default) 1.75 x T*K" in err and "hot rank of L3 receives 49,152" in err


def test_imbalance_unused_values_and_ep1_notes(capsys):
    assert plan_cli.run(parse("--imbalance", "1,1.5,1,1,1,1")) == 0
    err = capsys.readouterr().err
    assert "has 6 values but the slot has 4 layers: only the first 4 are used" in err
    assert plan_cli.run(parse("--ep", "1", "--experts", "8", "--imbalance", "3")) == 0
    err = capsys.readouterr().err
    assert "--imbalance ('3') has no effect at --ep 1" in err


def test_demo_routing_error_names_imbalance(capsys):
    err = _refused(capsys, *WORKED, "--imbalance", "0", "--device-scratch-factor", "1")
    assert "--imbalance ('0'), demo routing: received_rows[0][1] (8)" in err


def _without_notes(text: str) -> str:
    """The plan's output without the lines that say what it covers and what its received
    rows are (added after docs/memory.md's outputs were taken)."""
    text = text.replace(plan_cli.COVERAGE_NOTE, "")
    return re.sub(r"Received rows.*?(?=Save/replay decisions)", "", text, flags=re.S)


def test_documented_outputs_unchanged(tmp_path, capsys):
    """The two outputs of docs/memory.md, byte for byte apart from the coverage and
    received-rows notes (and no note on stderr)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    blocks = re.findall(r"```\n(distmoe memory plan:.*?)```", doc, re.S)
    assert len(blocks) == 2
    rows = _worked_rows(tmp_path)
    worked = parse(*WORKED, "--activation-bytes", "28672", "--rows-json", str(rows))
    for args, expected in ((worked, blocks[0]), (parse(), blocks[1])):
        assert plan_cli.run(args) == 0
        captured = capsys.readouterr()
        assert _without_notes(captured.out) == _without_notes(expected)
        assert captured.err == ""


def test_cli_errors_have_no_traceback(tmp_path):
    """Through ``python -m distmoe plan``: status 2, one stderr line, no table."""
    src = Path(plan_cli.__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "distmoe", "plan", "--json", str(tmp_path / "no" / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith("distmoe plan: error: --json ") and r.stderr.count("\n") == 1


def test_auto_rows_on_the_worked_example(tmp_path, capsys):
    """--auto-rows: the decisions table names what each layer keeps (DESIGN.md's rows at
    28,672 B: x, x, the rows, then a replay) and leaves the one-state monotonicity line out;
    --regather-rows with it is refused by argparse."""
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([[4, 4], [4, 4], [5, 3], [5, 3]]))
    args = parse(*WORKED, "--activation-bytes", "28672", "--rows-json", str(rows),
                 "--auto-rows")
    out_json = tmp_path / "plan.json"
    args.json = str(out_json)
    assert plan_cli.run(args) == 0
    out = capsys.readouterr().out
    saves = json.loads(out_json.read_text())["saves"]
    assert saves["kept"] == ["x", "x", "rows", "input"] and len(saves["x_state_bytes"]) == 4
    decisions = [line.split()[-1] if "replay" not in line else "replay"
                 for line in out.splitlines() if line.strip().startswith(("L0", "L1", "L2",
                                                                          "L3"))]
    assert decisions == ["x", "x", "save", "replay"], out
    assert "save_gathered_rows='auto'" in out and "is_capacity_monotone" not in out
    with pytest.raises(SystemExit):
        parse(*WORKED, "--auto-rows", "--regather-rows")


def test_memory_plan_says_what_it_covers_and_which_rows(tmp_path, capsys):
    """Under its header the plan says which memory it counts (one context's activation
    buffer: slots and scratch; not the weights, not the peers' buffers); above the
    save/replay table, that its rows are the assumed imbalanced demo routing, as demo_rows
    builds it (or the file's, or EP 1's every route)."""
    assert plan_cli.run(parse()) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[2].startswith("Covers one context's activation buffer on one rank: its slots")
    flat = " ".join(out.split())
    assert "Not counted: the weights and their gradients" in flat
    assert "the symmetric-heap buffers the peers read" in flat
    note = " ".join(out.split("Received rows: ")[1].split("Save/replay")[0].split())
    assert note == (
        "an assumed imbalanced demo routing, not measured and not balanced (--rows-json FILE "
        "gives real counts): in layer l, rank l % EP receives f x T*K rows, capped at the "
        "receive bound, f cycling through --imbalance 1.0,1.5,1.25,1.75 (the default); the "
        "other ranks share the remaining routes as evenly as possible.")
    assert out.index("Received rows:") < out.index("Save/replay decisions")
    assert plan_cli.run(parse("--imbalance", "2,1")) == 0
    out = capsys.readouterr().out
    assert "f cycling through --imbalance 2,1; the" in " ".join(out.split())
    assert plan_cli.run(parse("--ep", "1", "--experts", "8")) == 0
    assert "Received rows: at EP 1 the one rank receives every route" in \
        capsys.readouterr().out
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([[4, 4], [4, 4], [5, 3], [5, 3]]))
    assert plan_cli.run(parse(*WORKED, "--rows-json", str(rows))) == 0
    assert f"Received rows from --rows-json {rows}." in capsys.readouterr().out
    assert plan_cli.run(parse("--inference")) == 0
    out = capsys.readouterr().out
    assert "Covers one context's" in out and "Received rows" not in out


def test_kernel_plan_names_the_kernels():
    """``python -m distmoe plan --kernels --shape deepseek-v3 --device-class h100``: the
    shape, the device class and every forward kernel with its config; --training adds the
    backward ones."""
    src = Path(plan_cli.__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "distmoe", "plan", "--kernels", "--shape", "deepseek-v3",
         "--device-class", "h100"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(src)})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("deepseek-v3: T 4096, D 7168, F 2048, E 256 (32 per rank), K 8")
    assert "kernel plan: device class h100, EP=8, inference" in out
    for kernel in ("w13        Gluon warp-specialised W13", "w2         Gluon warp-specialised W2",
                   "combine    Triton owner combine", "layer      pull_all="):
        assert kernel in out, kernel
    assert "w2_dgrad" not in out


def test_kernel_plan_options(capsys):
    assert plan_cli.run(parse("--kernels", "--shape", "qwen3-30b-a3b", "--training", "--ep",
                              "2", "--device-class", "generic", "--call-tokens", "512")) == 0
    out = capsys.readouterr().out
    assert "kernel plan: device class generic, EP=2, training" in out
    for kernel in ("w2_dgrad", "w13_dgrad", "w2_wgrad", "w13_wgrad"):
        assert f"  {kernel} " in out
    assert "call with T=512:" in out
    # options over --shape; the default layer without one
    assert plan_cli.run(parse("--kernels", "--shape", "dense-e32", "--tokens", "64", "--ep",
                              "1", "--device-class", "h200")) == 0
    assert capsys.readouterr().out.startswith("dense-e32: T 64, D 4096, F 2048, E 32 (32 per")
    assert plan_cli.run(parse("--kernels", "--device-class", "h100")) == 0
    assert capsys.readouterr().out.startswith("T 4096, D 2048, F 768, E 128 (16 per rank)")


@pytest.mark.parametrize("argv,message", [
    (("--kernels", "--json", "x.json"), "--json: memory-plan options, no effect with --kernels"),
    (("--rules", "--imbalance", "1,2"), "--imbalance: memory-plan options, no effect with --rules"),
    (("--kernels", "--rules"), "--kernels and --rules: one of them"),
    (("--device-class", "h100",), "--device-class: a kernel-plan option, no effect without"),
    (("--call-tokens", "4",), "--call-tokens: a kernel-plan option, no effect without"),
    (("--training",), "--training: the memory plan is for training unless --inference"),
    (("--kernels", "--call-tokens", "5000"), "--call-tokens (5000) must be in [1, --tokens (4096)]"),
    (("--kernels", "--ep", "3"), "--experts (128) must be divisible by --ep (3)"),
])
def test_kernel_plan_option_errors(argv, message, capsys):
    assert plan_cli.run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("distmoe plan: error: ") and message in err and err.count("\n") == 1


def test_rules_print_the_threshold_table(capsys):
    from distmoe.plan import thresholds

    assert plan_cli.run(parse("--rules", "--device-class", "h200")) == 0
    out = capsys.readouterr().out
    assert out.startswith("kernel-plan thresholds of device class h200")
    for name, row in thresholds("h200").rows():
        assert f"  {name} = {row.value}\n" in out
        assert f"      evidence: {row.evidence}\n" in out
        assert " ".join(row.reason.split()) in " ".join(out.split())
    assert plan_cli.run(parse("--rules", "--device-class", "generic")) == 0
    assert "generic: the Triton kernels only" in capsys.readouterr().out
