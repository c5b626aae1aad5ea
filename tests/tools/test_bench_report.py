"""Benchmark outputs: CSV schema and types, strict JSON, plots, table, environment record."""

import csv
import json
import math

from distmoe.tools.bench import report
from distmoe.tools.bench.micro import MICRO_COLUMNS, MicroRow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _case(provider="torch", status="ok", mode="fwd", tflops=500.0, **kw):
    base = dict(
        provider=provider,
        status=status,
        shape="dense-e32",
        tokens=8192,
        hidden=4096,
        ffn=2048,
        num_experts=32,
        top_k=8,
        ep_size=1,
        imbalance=1.0,
        precision="bf16",
        mode=mode,
    )
    if status == "ok":
        base.update(
            timing_method="cuda_graph",
            iter_ms=2.0,
            window_min_ms=1.9,
            window_max_ms=2.2,
            tflops=tflops,
            pct_dense=tflops / 7.5,
            hbm_gbps=1800.0,
            nvlink_gbps=0.0,
            peak_mem_gib=12.5,
            achieved_imbalance=1.0,
            tracked_rows=8192,
            max_rel_err_vs_torch=0.0,
            case_seconds=3.0,
            window_ms=[2.0, 1.9, 2.2, 2.0, 2.1],
        )
    base.update(kw)
    return report.CaseResult(**base)


def test_case_csv_columns_and_types(tmp_path):
    cases = [
        _case(),
        _case(provider="distmoe", status="unavailable", note="no MoEContext"),
        _case(mode="fwdbwd", tflops=math.nan),
    ]
    path = report.write_csv(
        tmp_path / "cases.csv", [c.as_row() for c in cases], list(report.CASE_COLUMNS)
    )
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        body = list(reader)
    assert header == list(report.CASE_COLUMNS)
    for col in (
        "provider",
        "shape",
        "imbalance",
        "precision",
        "mode",
        "iter_ms",
        "window_min_ms",
        "window_max_ms",
        "tflops",
        "pct_dense",
        "pct_dense_sustained",
        "hbm_gbps",
        "nvlink_gbps",
        "peak_mem_gib",
    ):
        assert col in header
    assert len(body) == 3 and all(len(r) == len(header) for r in body)

    rows = report.read_cases_csv(path)
    ok, missing, nan = rows
    for name, typ in report.CASE_COLUMNS.items():
        assert ok[name] is None or isinstance(ok[name], typ), name
    assert ok["iter_ms"] == 2.0 and ok["tokens"] == 8192 and ok["timing_method"] == "cuda_graph"
    assert missing["status"] == "unavailable" and missing["iter_ms"] is None
    assert missing["note"] == "no MoEContext"
    assert nan["tflops"] is None  # NaN is written as an empty cell


def test_json_is_strict_and_keeps_windows(tmp_path):
    payload = {"cases": [_case().as_dict(), _case(tflops=math.inf).as_dict()], "x": (1, math.nan)}
    text = report.write_json(tmp_path / "r.json", payload).read_text()
    data = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert data["cases"][0]["window_ms"] == [2.0, 1.9, 2.2, 2.0, 2.1]
    assert data["cases"][1]["tflops"] is None
    assert data["x"] == [1, None]


def test_micro_csv_columns(tmp_path):
    row = MicroRow(
        benchmark="histogram",
        provider="grouped_mm",
        variant="three_hot",
        experts=16,
        d=4096,
        h=4096,
        rows=65536,
        iter_ms=1.0,
        tflops=900.0,
        relative=0.9,
    )
    path = report.write_csv(tmp_path / "micro.csv", [row.as_dict()], MICRO_COLUMNS)
    with path.open(newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == list(MICRO_COLUMNS)
    assert got[0]["variant"] == "three_hot" and float(got[0]["tflops"]) == 900.0
    assert got[0]["window_min_ms"] == ""  # unmeasured -> empty


def test_plots_are_written(tmp_path):
    cases = [
        _case(),
        _case(provider="torch_compile", tflops=550.0),
        _case(mode="fwdbwd", tflops=400.0),
        _case(provider="distmoe", status="failed"),
    ]
    intensity = {id(c): 300.0 for c in cases}
    paths = [
        report.plot_tflops(cases, 750.0, tmp_path / "tflops.png"),
        report.plot_roofline(
            cases,
            peak_tflops=750.0,
            hbm_gbps=4200.0,
            intensity=intensity,
            path=tmp_path / "roofline.png",
            source="measured",
        ),
        report.plot_roofline_model(
            {
                "seed": [
                    {"tokens": 1, "dense_fraction": 0.1, "moe_fraction": 0.01},
                    {"tokens": 2, "dense_fraction": 0.2, "moe_fraction": 0.02},
                ]
            },
            source="measured",
            path=tmp_path / "model.png",
        ),
    ]
    micro_rows = [
        MicroRow(benchmark="grouped_vs_bmm", provider=p, d=2048, h=2048, rows=m, tflops=t).as_dict()
        for p, m, t in (
            ("grouped_mm", 4096, 300.0),
            ("bmm", 4096, 350.0),
            ("grouped_mm", 8192, 500.0),
            ("bmm", 8192, 450.0),
        )
    ] + [
        MicroRow(
            benchmark="histogram",
            provider="grouped_mm",
            variant=v,
            rows=65536,
            tflops=1.0,
            relative=r,
            max_load_ratio=5.07,
        ).as_dict()
        for v, r in (("balanced", 1.0), ("single_spike", 0.9), ("three_hot", 0.8))
    ]
    paths += report.plot_micro(micro_rows, tmp_path)
    assert len(paths) == 5
    for p in paths:
        assert p is not None and p.read_bytes()[:8] == PNG_MAGIC
    assert report.plot_tflops([_case(status="failed")], None, tmp_path / "none.png") is None


def test_table_and_environment():
    text = report.format_table(
        [_case(), _case(provider="distmoe", status="unavailable", note="x")],
        [{"name": "dense_bf16", "value": 750.0, "unit": "TFLOP/s"}],
    )
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["provider", "shape", "T"]
    assert any(line.startswith("torch") and "500.0" in line for line in lines)
    assert any(line.startswith("distmoe") and "unavailable" in line for line in lines)
    assert lines[-1].startswith("ceiling dense_bf16")
    env = report.environment(["bench", "--full"])
    for key in ("gpu", "torch", "triton", "distmoe", "git_sha", "date_utc", "command"):
        assert isinstance(env[key], str) and env[key]
    assert env["command"].endswith("bench --full")


def test_table_columns_never_touch():
    """Wide values (seconds-long iterations, a long shape name) widen their column: every
    column stays at least two spaces from the next."""
    import re

    wide = _case(provider="torch_compile", shape="deepseek-v4-flash/ep2", tokens=65536,
                 mode="fwdbwd", iter_ms=1734.4131, window_min_ms=1683.212,
                 window_max_ms=1785.613, tflops=12345.6, pct_dense=1234.0,
                 pct_dense_sustained=1456.0, hbm_gbps=123456.0, sm_clock_mhz=1980.0,
                 power_w=699.0, peak_mem_gib=123.45)
    failed = _case(provider="distmoe", status="failed", shape="smoke", tokens=64,
                   note="RuntimeError: boom")
    text = report.format_table([_case(), wide, failed])
    lines = text.splitlines()
    fields = [re.split(r" {2,}", line.strip()) for line in [lines[0], *lines[2:]]]
    assert fields[0] == ["provider", "shape", "T", "mode", "imb", "graph ms", "eager ms",
                         "host ms", "range", "TFLOP/s", "%dense", "%sust", "HBM GB/s", "MHz",
                         "W", "peak GiB", "status"]
    assert fields[2] == ["torch_compile", "deepseek-v4-flash/ep2", "65536", "fwdbwd", "1",
                         "1734.413", "-", "-", "1683.212-1785.613", "12345.6", "1234", "1456",
                         "123456", "1980", "699", "123.45", "ok"]
    assert fields[1][:9] == ["torch", "dense-e32", "8192", "fwd", "1", "2.000", "-", "-",
                             "1.900-2.200"]
    assert fields[3][:8] == ["distmoe", "smoke", "64", "fwd", "1", "-", "-", "-"]
    assert fields[3][-1] == "failed: RuntimeError: boom"
    assert "1734.4131683.212" not in text
    assert len(lines[1]) == len(lines[0]) and set(lines[1]) == {"-"}
    # the columns line up: the ms title ends where the right-aligned values end
    end_ms = lines[0].index("graph ms") + len("graph ms")
    assert lines[3][:end_ms].endswith("1734.413") and lines[2][:end_ms].endswith("2.000")


def test_git_sha_names_the_commit_a_remote_copy_was_sent_from(monkeypatch):
    # a working-tree copy run on another machine may carry a stale .git: $DISTMOE_GIT_SHA,
    # when set, is what the run records; unset, the checkout's own commit
    monkeypatch.delenv("DISTMOE_GIT_SHA", raising=False)
    own = report.environment(["bench"])["git_sha"]
    assert own and own != "0123abc"
    monkeypatch.setenv("DISTMOE_GIT_SHA", "0123abc")
    assert report.environment(["bench"])["git_sha"] == "0123abc"


def test_output_check_tolerates_each_precisions_rounding():
    """The forward check against the bf16 torch baseline flags an error past the precision's
    tolerance (cli.OUTPUT_TOLERANCE): 0.1 of max |y| is a broken bf16 kernel but within FP8's
    operand roundings; 0.3 is past FP8's and within FP4 weights'."""
    from distmoe.tools.bench import cli
    from distmoe.tools.bench.timing import ModeResults, TimingConfig, TimingResult, WindowStats

    config = TimingConfig()
    stats = WindowStats(iter_ms=1.0, min_ms=0.9, max_ms=1.1, window_ms=(1.0,) * 5)
    res = ModeResults(graph=TimingResult(stats=stats, method="cuda_graph", config=config,
                                         fallback_reason=""), eager=None)

    def note(precision, err):
        row = _case(provider="distmoe", precision=precision, max_rel_err_vs_torch=err)
        (out,) = cli.case_rows(row, res)
        return out.note

    def flagged(precision, err):
        return "OUTPUT DIFFERS" in note(precision, err)

    assert flagged("bf16", 0.1) and not flagged("bf16", 0.01)
    assert not flagged("fp8_block", 0.1) and not flagged("mxfp8", 0.1)
    assert flagged("fp8_block", 0.3) and flagged("mxfp8", 0.3)
    assert not flagged("nvfp4", 0.3) and flagged("nvfp4", 0.6)
    assert "0.3 of max |y| > 0.25 at mxfp8" in note("mxfp8", 0.3)
