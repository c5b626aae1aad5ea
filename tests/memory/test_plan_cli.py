"""``distmoe plan`` command line: parsed arguments in, table / JSON / PNG out."""

from __future__ import annotations

import argparse
import json
import re

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
        (("--activation-bytes", "1000"), r"activation_bytes \(1000\) must be >= the inputs-only"),
        (("--ep", "3"), r"num_experts \(128\) must be divisible by ep_size \(3\)"),
        (("--hidden", "0"), r"hidden \(0\) must be >= 1"),
        (("--imbalance", "a,b"), r"--imbalance \('a,b'\) must be comma-separated numbers"),
        (("--layers-per-slot", "0"), r"max_layers_per_slot \(0\) must be >= 1"),
    ],
)
def test_bad_input_exits_2(argv, message, capsys):
    assert plan_cli.run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert "distmoe plan: error:" in err
    assert re.search(message, err), err


def test_rows_above_bound_exit_2(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    rows.write_text("[[9, 0]]")
    assert plan_cli.run(parse(*WORKED, "--rows-json", str(rows))) == 2
    assert "must be <= the receive bound (8 rows)" in capsys.readouterr().err
