"""Command line: option resolution, and an end-to-end CPU smoke run of the harness."""

import argparse
import json
import math
import tarfile

import pytest
import torch

from distmoe.tools import INTERPRETER_NOTE
from distmoe.tools.bench import baseline, cli, providers, report, workloads
from distmoe.tools.bench.groups import init_single_process_group


def _parse(argv):
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_default_plan():
    plan = cli.resolve_plan(_parse([]))
    assert tuple(s.name for s in plan.shapes) == workloads.DEFAULT_SHAPES
    assert workloads.DEFAULT_SHAPES == ("dense-e32", "qwen3-30b-a3b-t2048", "qwen3-30b-a3b",
                                        "deepseek-v3")
    assert plan.modes == ("fwd", "fwdbwd")
    assert plan.imbalances == (1.0,)
    assert plan.providers == ("distmoe", "torch", "torch_compile", "transformers", "rowwise")
    assert not plan.micro and not plan.roofline
    cfg = plan.timing
    assert (cfg.num_warmup, cfg.num_windows, cfg.iters_per_window, cfg.capture_iters) == (
        10,
        5,
        30,
        30,
    )
    assert plan.num_cases() == len(workloads.DEFAULT_SHAPES) * 2 * 5
    assert plan.routing == "exact"


def test_full_and_explicit_plan():
    full = cli.resolve_plan(_parse(["--full"]))
    assert tuple(s.name for s in full.shapes) == workloads.FULL_SHAPES
    assert full.imbalances == (1.0, 4.0, 8.0) and full.micro and full.micro_full and full.roofline
    plan = cli.resolve_plan(
        _parse(
            [
                "--shapes",
                "qwen3-30b-a3b",
                "olmoe",
                "--tokens",
                "1024",
                "2048",
                "--mode",
                "fwd",
                "--imbalance",
                "1",
                "4",
                "--providers",
                "torch",
                "--capture-iters",
                "1",
            ]
        )
    )
    assert [s.name for s in plan.shapes] == ["qwen3-30b-a3b", "olmoe"]
    assert plan.tokens_for(plan.shapes[0]) == (1024, 2048)
    assert plan.modes == ("fwd",) and plan.providers == ("torch",)
    assert plan.timing.capture_iters == 1
    assert plan.num_cases() == 2 * 2 * 1 * 2 * 1
    with pytest.raises(ValueError, match="imbalance"):
        cli.resolve_plan(_parse(["--imbalance", "0.5"]))
    with pytest.raises(SystemExit):
        _parse(["--shapes", "mixtral"])


def test_rank_share_divides_the_experts():
    plan = cli.resolve_plan(_parse(["--shapes", "dense-e32", "qwen3-30b-a3b",
                                    "--rank-share-of", "2"]))
    a, q = plan.shapes
    assert (a.name, a.num_experts, a.tokens, a.top_k) == ("dense-e32/ep2", 16, 8192, 8)
    assert (q.name, q.num_experts) == ("qwen3-30b-a3b/ep2", 64)
    dense = workloads.SHAPES["dense-e32"]
    assert (a.hidden, a.ffn) == (dense.hidden, dense.ffn)
    assert cli.resolve_plan(_parse(["--shapes", "qwen3-30b-a3b"])).shapes[0] is \
        workloads.SHAPES["qwen3-30b-a3b"]
    # dense-e32 has E=32, K=8: a share of 8 ranks leaves 4 experts, fewer than top_k.
    with pytest.raises(ValueError, match=r"--rank-share-of \(8\) must divide the experts of "
                       r"shape 'dense-e32' \(E=32\) and leave at least top_k \(8\)"):
        cli.resolve_plan(_parse(["--shapes", "dense-e32", "--rank-share-of", "8"]))
    with pytest.raises(ValueError, match=r"--rank-share-of \(0\) must be an int >= 1"):
        cli.resolve_plan(_parse(["--shapes", "qwen3-30b-a3b", "--rank-share-of", "0"]))


def test_distmoe_provider_unavailable_without_context(monkeypatch):
    import distmoe

    monkeypatch.delattr(distmoe, "MoEContext", raising=False)
    bg = init_single_process_group("cpu")
    try:
        p = providers.build_provider(
            "distmoe",
            shape=workloads.SHAPES["smoke"],
            tokens=64,
            training=False,
            bench_group=bg,
            device=torch.device("cpu"),
        )
    finally:
        bg.close()
    assert p.status == "unavailable" and p.layer is None and "MoEContext" in p.note


def test_cpu_smoke_run_writes_outputs(tmp_path, capsys):
    out = tmp_path / "bench"
    args = _parse(
        [
            "--shapes",
            "smoke",
            "--device",
            "cpu",
            "--providers",
            "torch",
            "--imbalance",
            "1",
            "2",
            "--warmup",
            "1",
            "--windows",
            "2",
            "--iters",
            "1",
            "--roofline",
            "--out",
            str(out),
            "--archive",
            str(tmp_path / "bench.tar.gz"),
        ]
    )
    assert cli.run(args) == 0
    names = {p.name for p in out.iterdir()}
    assert {
        "cases.csv",
        "ceilings.csv",
        "results.json",
        "roofline_model.csv",
        "tflops.png",
        "roofline.png",
        "roofline_model.png",
    } <= names
    rows = report.read_cases_csv(out / "cases.csv")
    assert len(rows) == 4  # 2 modes x 2 imbalances x 1 provider
    assert {r["status"] for r in rows} == {"ok"}
    assert {r["timing_method"] for r in rows} == {"cpu"}
    assert {r["achieved_imbalance"] for r in rows} == {1.0, 2.0}
    # exact routing gives every expert rows: the HBM model reads every expert's weights
    assert {r["active_experts"] for r in rows} == {rows[0]["num_experts"]}
    assert all(r["max_rel_err_vs_torch"] == 0.0 for r in rows)  # the reference is the baseline
    assert {r["baseline_path"] for r in rows} == {baseline.grouped_mm_path("cpu")[0]}
    data = json.loads((out / "results.json").read_text())
    assert data["environment"]["ep_size"] == 1
    assert len(data["cases"][0]["window_ms"]) == 2
    assert data["roofline_model"]["source"] == "H200 datasheet"  # no ceilings on CPU
    with tarfile.open(tmp_path / "bench.tar.gz") as tar:
        assert {m.name for m in tar.getmembers()} == {f"bench/{n}" for n in names}
    printed = capsys.readouterr().out.splitlines()
    # the text table comes last, then (CPU) the note that its times are the interpreter's,
    # then (exact routing) the note on the histogram
    assert printed[-1].startswith("routing: exact (every expert gets T*K/E rows")
    assert "--routing sampled" in printed[-1]
    assert printed[-3] == f"note: {INTERPRETER_NOTE}"
    assert "say nothing about GPU speed" in printed[-3]
    assert printed[-5].startswith("ceiling peer_read") and printed[-4] == ""
    assert any(line.startswith("provider") for line in printed)
    assert not torch.distributed.is_initialized()  # the private group was torn down
    # --tables: the markdown table of this run's results.json
    assert cli.main(["--tables", str(out / "results.json")]) == 0
    tables = capsys.readouterr().out
    assert tables.startswith("### ") and "| `smoke` | 64, 64, 32, 8, 2 |" in tables
    assert cli.main(["--tables", str(tmp_path / "missing.json")]) == 2
    assert "distmoe bench: error: --tables: results file" in capsys.readouterr().err


def test_cpu_smoke_run_distmoe_training(tmp_path):
    """distmoe forward+backward through the harness (priming, warm-up and timed steps on one
    context): every step's backward releases its slot, so no step finds the slot full. Three
    runs, each with options (the plain run's checks ride on the one that keeps the default
    activation factor)."""
    # --activation-factor (a larger slot) and --drop-route-outputs (a smaller peak) reach
    # the config and the row's note (one run for both)
    out2 = tmp_path / "bench2"
    args = _parse(["--shapes", "smoke", "--device", "cpu", "--providers", "distmoe",
                   "--mode", "fwdbwd", "--warmup", "1", "--windows", "2", "--iters", "1",
                   "--activation-factor", "2", "--drop-route-outputs", "--no-plots",
                   "--no-ceilings", "--out", str(out2)])
    bench = cli.resolve_plan(args)
    assert bench.activation_factor == 2.0 and bench.save_route_outputs is False
    assert cli.run(args) == 0
    rows = report.read_cases_csv(out2 / "cases.csv")
    assert rows[0]["status"] == "ok", rows
    assert "activation_factor=2" in rows[0]["note"], rows
    assert "no route outputs in the slot" in rows[0]["note"], rows
    assert rows[0]["max_rel_err_vs_torch"] < 0.05
    with pytest.raises(ValueError, match=r"--activation-factor \(0.0\) must be > 0"):
        cli.resolve_plan(_parse(["--activation-factor", "0"]))
    # --regather-rows (and --rows-in-place) reach the config and the row's note
    for way, note in (("auto", "input kept, rows copied"),
                      ("on", "input kept, rows read in place")):
        out4 = tmp_path / f"bench4_{way}"
        args = _parse(["--shapes", "smoke", "--device", "cpu", "--providers", "distmoe",
                       "--mode", "fwdbwd", "--warmup", "1", "--windows", "2", "--iters", "1",
                       "--regather-rows", "--rows-in-place", way, "--no-plots",
                       "--no-ceilings", "--out", str(out4)])
        bench = cli.resolve_plan(args)
        assert bench.save_gathered_rows is False
        assert bench.gathered_rows_in_place is {"auto": None, "on": True}[way]
        assert cli.run(args) == 0
        kept = report.read_cases_csv(out4 / "cases.csv")
        assert [(r["provider"], r["mode"], r["status"]) for r in kept] == \
            [("distmoe", "fwdbwd", "ok")], kept
        assert note in kept[0]["note"] and "activation_factor" not in kept[0]["note"], kept
        assert kept[0]["max_rel_err_vs_torch"] < 0.05
        assert kept[0]["routing"] == "exact"
    with pytest.raises(ValueError, match=r"--rows-in-place on needs --regather-rows"):
        cli.resolve_plan(_parse(["--rows-in-place", "on"]))


def test_sampled_routing_run_and_rules(tmp_path, capsys):
    """--routing sampled reaches the cases (recorded in cases.csv, ``smp`` in the table) and
    refuses an imbalance factor (the knob needs an exact histogram)."""
    with pytest.raises(ValueError, match=r"--imbalance \(1 2\) needs --routing exact"):
        cli.resolve_plan(_parse(["--routing", "sampled", "--imbalance", "1", "2"]))
    with pytest.raises(SystemExit):  # argparse: not a choice
        _parse(["--routing", "uniform"])
    out = tmp_path / "bench"
    args = _parse(["--shapes", "smoke", "--device", "cpu", "--providers", "torch",
                   "--mode", "fwd", "--routing", "sampled", "--warmup", "1", "--windows", "2",
                   "--iters", "1", "--no-plots", "--no-ceilings", "--tokens", "1",
                   "--out", str(out)])
    assert cli.resolve_plan(args).routing == "sampled"
    assert cli.run(args) == 0
    rows = report.read_cases_csv(out / "cases.csv")
    assert [(r["routing"], r["status"]) for r in rows] == [("sampled", "ok")], rows
    # one token: the HBM model reads the weights of its K experts only
    assert rows[0]["active_experts"] == rows[0]["top_k"] < rows[0]["num_experts"]
    table = capsys.readouterr().out.splitlines()
    assert any(line.startswith("torch") and " smp " in line for line in table)
    assert not any(line.startswith("routing: exact") for line in table)


def test_replot_redraws_a_run_under_current_shape_names(tmp_path, capsys):
    """--replot: the plots and the table of a finished run from its results.json, a shape of
    an older run (``fine``) shown by its current name; a file that is no results.json is one
    error line."""
    out = tmp_path / "bench"
    args = _parse(["--shapes", "smoke", "--device", "cpu", "--providers", "torch", "--mode",
                   "fwd", "--warmup", "1", "--windows", "1", "--iters", "1", "--roofline",
                   "--no-plots", "--no-ceilings", "--out", str(out)])
    assert cli.run(args) == 0
    data = json.loads((out / "results.json").read_text())
    data["cases"][0]["shape"] = "fine"
    data["roofline_model"]["curves"]["fine"] = data["roofline_model"]["curves"].pop("smoke")
    (out / "results.json").write_text(json.dumps(data))
    capsys.readouterr()
    plots = tmp_path / "plots"
    assert cli.main(["--replot", str(out / "results.json"), "--out", str(plots)]) == 0
    assert {p.name for p in plots.iterdir()} >= {"tflops.png", "roofline.png",
                                                  "roofline_model.png"}
    printed = capsys.readouterr().out
    assert any(line.startswith("torch") and " qwen3-30b-a3b " in line
               for line in printed.splitlines()), printed
    assert cli.main(["--replot", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distmoe bench: error: --replot ") and "not a readable" in err


def test_fill_metrics_against_both_dense_ceilings():
    row = report.CaseResult(provider="distmoe", status="ok", shape="dense-e32", tokens=8192,
                            hidden=4096, ffn=2048, num_experts=32, top_k=8, ep_size=1,
                            imbalance=1.0, precision="bf16", mode="fwd", iter_ms=5.5)
    cli.fill_metrics(row, 800.0, 680.0)
    useful = 6 * 8192 * 8 * 4096 * 2048 / 5.5e-3 / 1e12
    assert math.isclose(row.tflops, useful)
    assert math.isclose(row.pct_dense, 100 * useful / 800.0)
    assert math.isclose(row.pct_dense_sustained, 100 * useful / 680.0)
    unmeasured = report.CaseResult(**{**row.__dict__, "pct_dense_sustained": None})
    cli.fill_metrics(unmeasured, 800.0, None)  # no sustained ceiling: the field stays empty
    assert unmeasured.pct_dense_sustained is None


def test_launched_by_torchrun_counts_a_one_process_run(monkeypatch):
    """torch.distributed.run with one process sets WORLD_SIZE=1 and its run id: its ranks
    must join through env:// (a store of their own waits on the agent's, which hung
    ``distmoe ab`` under ``--nproc-per-node=1``)."""
    from distmoe.tools.bench.groups import launched_by_torchrun

    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not launched_by_torchrun()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launched_by_torchrun()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_by_torchrun()


def test_cpu_smoke_run_low_precision(tmp_path):
    # --precision: the distmoe provider runs its MXFP8 inference layer on weights prepared
    # once, beside the rowwise-FP8 torch baseline; rows carry their bytes model's precision;
    # the FP4 precisions are refused outside --mode fwd
    out = tmp_path / "bench"
    args = _parse(["--shapes", "smoke", "--device", "cpu", "--providers", "distmoe",
                   "torch_fp8", "--mode", "fwd", "--precision", "mxfp8", "--warmup", "1",
                   "--windows", "1", "--iters", "1", "--out", str(out)])
    assert cli.run(args) == 0
    rows = report.read_cases_csv(out / "cases.csv")
    assert {(r["provider"], r["status"], r["precision"]) for r in rows} == {
        ("distmoe", "ok", "mxfp8"), ("torch_fp8", "ok", "fp8_block")}
    with pytest.raises(ValueError, match="--precision nvfp4 is inference only"):
        cli.resolve_plan(_parse(["--precision", "nvfp4"]))


def test_cpu_smoke_run_per_transport(tmp_path, capsys):
    # --transport: the distmoe provider once per transport in one run (gloo stands in for
    # NCCL on the CPU), each row naming its transport; the other providers once, with none
    out = tmp_path / "bench"
    args = _parse(["--shapes", "smoke", "--device", "cpu", "--providers", "distmoe", "torch",
                   "--mode", "fwd", "--transport", "peer", "nccl", "--warmup", "1",
                   "--windows", "1", "--iters", "1", "--no-plots", "--no-ceilings",
                   "--out", str(out)])
    plan = cli.resolve_plan(args)
    assert plan.case_providers() == [("distmoe", "peer"), ("distmoe", "nccl"), ("torch", "")]
    assert plan.num_cases() == 3
    assert cli.run(args) == 0
    rows = report.read_cases_csv(out / "cases.csv")
    assert [(r["provider"], r["transport"], r["status"]) for r in rows] == [
        ("distmoe", "peer", "ok"), ("distmoe", "nccl", "ok"), ("torch", "", "ok")], rows
    # the two distmoe rows are different cases, and a row without the column is peer's
    assert len({report.case_key(r) for r in rows}) == 3
    assert report.case_key({**rows[0], "transport": ""}) == report.case_key(rows[0])
    table = capsys.readouterr().out.splitlines()
    assert any(line.startswith("distmoe/nccl ") for line in table)
    with pytest.raises(SystemExit):  # argparse: not a choice
        _parse(["--transport", "tcp"])
