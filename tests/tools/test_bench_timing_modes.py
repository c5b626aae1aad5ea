"""``--timing graph|eager|both`` of ``python -m distmoe bench`` and the host time per call
(issue 66): the option, the host-time helper's logic on a simulated GPU and clock, the rows a
run writes (CPU, and graph plus eager figures from a stand-in timer), and the markdown tables
of new and old results files."""

import argparse
import json
import math
import time

import pytest

from distmoe.tools.bench import cli, report
from distmoe.tools.bench.timing import (
    HOST_ATTEMPTS,
    HostTime,
    ModeResults,
    TimingConfig,
    TimingResult,
    WindowStats,
    benchmark,
    benchmark_modes,
    host_time_per_call,
)


def _parse(argv):
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(argv)


# ----------------------------------------------------------------------------- the option


def test_timing_option_parses_and_no_graph_is_its_eager_alias():
    assert cli.resolve_plan(_parse([])).timing_mode == "both"
    for mode in ("graph", "eager", "both"):
        plan = cli.resolve_plan(_parse(["--timing", mode]))
        assert plan.timing_mode == mode
        assert plan.timing.use_cuda_graph is (mode != "eager")  # the ceilings follow it
    plan = cli.resolve_plan(_parse(["--no-graph"]))
    assert plan.timing_mode == "eager" and not plan.timing.use_cuda_graph
    assert cli.resolve_plan(_parse(["--no-graph", "--timing", "eager"])).timing_mode == "eager"
    with pytest.raises(ValueError, match="--no-graph is --timing eager; it contradicts "
                                         "--timing both"):
        cli.resolve_plan(_parse(["--no-graph", "--timing", "both"]))
    with pytest.raises(SystemExit):
        _parse(["--timing", "replay"])
    text = " ".join(cli.add_arguments(argparse.ArgumentParser()).format_help().split())
    assert "--timing {graph,eager,both}" in text
    assert "--no-graph alias of --timing eager" in text
    assert "default both" in text and "host's time per call" in text


# ----------------------------------------------------------------------------- host time


class FakeClock:
    """A clock that moves only when told (seconds)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeGpu:
    """A GPU queue on a :class:`FakeClock`: a sleep keeps it busy until ``busy_until``;
    ``synchronize`` waits for it. ``queue_depth`` calls fill its launch queue (the next call
    waits for the GPU), None for no limit."""

    def __init__(self, clock, queue_depth=None):
        self.clock, self.busy_until, self.queue_depth = clock, clock.now, queue_depth
        self.sleeps, self.queued = [], 0

    def sleep(self, ms):
        self.sleeps.append(ms)
        self.busy_until = max(self.clock.now, self.busy_until) + ms / 1e3
        self.queued = 0
        return lambda: self.clock.now >= self.busy_until

    def synchronize(self):
        self.clock.now = max(self.clock.now, self.busy_until)
        self.queued = 0

    def launch(self, host_s):
        """One call: ``host_s`` of host work, waiting first where the queue is full."""
        if self.queue_depth is not None and self.queued >= self.queue_depth:
            self.synchronize()
        self.queued += 1
        self.clock.now += host_s


def test_host_time_of_calls_issued_ahead_of_the_gpu():
    clock = FakeClock()
    gpu = FakeGpu(clock)
    calls = []

    def fn():
        calls.append(1)
        gpu.launch(0.4e-3)

    res = host_time_per_call(fn, calls=10, wall_ms_per_call=2.0, rounds=3, gpu=gpu, clock=clock)
    assert isinstance(res, HostTime) and not res.synced
    assert res.ms == pytest.approx(0.4) and res.rounds == 3 and res.calls == 10
    assert len(calls) == 30  # every round counted at once
    # the first sleep covers twice the calls' wall time, later ones three times the host time
    assert gpu.sleeps[0] == pytest.approx(2 * 10 * 2.0 + 10)
    assert gpu.sleeps[1] == pytest.approx(3 * 10 * 0.4 + 10)


def test_host_time_is_sync_for_a_function_that_waits_for_the_gpu():
    """A call that synchronises (``.item()``) waits out the queued sleep: no host time, not
    the sleep's length. The helper confirms with one call behind a longer sleep, then stops."""
    clock = FakeClock()
    gpu = FakeGpu(clock)
    calls = []

    def fn():
        calls.append(1)
        gpu.synchronize()  # the host waits for the GPU
        clock.now += 0.1e-3

    res = host_time_per_call(fn, calls=10, wall_ms_per_call=1.0, rounds=3, gpu=gpu, clock=clock)
    assert res.synced and math.isnan(res.ms) and res.rounds == 0
    assert len(gpu.sleeps) == 2 and gpu.sleeps[1] == 4 * gpu.sleeps[0]
    assert len(calls) == 10 + 1  # one round of ten, then the single confirming call


def test_host_time_recovers_from_a_full_launch_queue_and_a_short_sleep():
    """A launch queue that fills after 3 calls, and a wall estimate that sizes the first
    sleep too short: fewer calls behind longer sleeps until the host stays ahead."""
    clock = FakeClock()
    gpu = FakeGpu(clock, queue_depth=3)
    res = host_time_per_call(lambda: gpu.launch(0.5e-3), calls=20, wall_ms_per_call=0.0,
                             rounds=2, gpu=gpu, clock=clock)
    assert not res.synced and res.ms == pytest.approx(0.5)
    assert res.calls <= 3 and res.rounds == 2
    # a slow host (30 ms per call) behind a 20 ms first sleep: retried, not called sync
    clock = FakeClock()
    gpu = FakeGpu(clock)
    res = host_time_per_call(lambda: gpu.launch(30e-3), calls=4, wall_ms_per_call=0.0,
                             rounds=1, gpu=gpu, clock=clock)
    assert not res.synced and res.ms == pytest.approx(30.0)
    assert gpu.sleeps[0] == 20.0 and len(gpu.sleeps) > 1


def test_host_time_gives_up_after_its_attempts():
    """Calls slower than the longest sleep allowed count as synchronising (no number that
    would be the sleep's length)."""
    clock = FakeClock()
    gpu = FakeGpu(clock)
    res = host_time_per_call(lambda: gpu.launch(1.0), calls=8, wall_ms_per_call=0.0, rounds=1,
                             gpu=gpu, clock=clock, max_sleep_ms=100.0)
    assert res.synced and len(gpu.sleeps) <= HOST_ATTEMPTS


def test_host_time_with_the_real_clock():
    """The same logic against time.perf_counter: a 'GPU' that is a deadline, a synchronising
    function that sleeps until it; a function that returns at once is not sync."""

    class DeadlineGpu:
        def __init__(self):
            self.deadline = time.perf_counter()

        def sleep(self, ms):
            self.deadline = time.perf_counter() + ms / 1e3
            return lambda: time.perf_counter() >= self.deadline

        def synchronize(self):
            time.sleep(max(0.0, self.deadline - time.perf_counter()))

    gpu = DeadlineGpu()
    start = time.perf_counter()
    res = host_time_per_call(gpu.synchronize, calls=5, wall_ms_per_call=0.0, rounds=2, gpu=gpu)
    assert res.synced and math.isnan(res.ms)
    res = host_time_per_call(lambda: None, calls=5, wall_ms_per_call=0.0, rounds=2, gpu=gpu)
    assert not res.synced and 0 <= res.ms < 5.0
    assert time.perf_counter() - start < 5.0
    with pytest.raises(ValueError, match=r"calls \(0\)"):
        host_time_per_call(lambda: None, calls=0, wall_ms_per_call=0.0, gpu=gpu)


# ----------------------------------------------------------------------------- timing on CPU


def test_benchmark_modes_on_cpu_is_one_eager_figure_with_wall_time_as_host_time():
    calls = []
    cfg = TimingConfig(num_warmup=1, num_windows=3, iters_per_window=2, capture_iters=2)
    res = benchmark_modes(lambda: calls.append(1), timing="both", config=cfg, device="cpu")
    assert len(calls) == 1 + 3 * 2  # timed once, not once per timing
    assert res.graph is None and res.graph_reason == ""
    assert res.eager.method == "cpu" and res.results() == [res.eager]
    assert res.eager.host.ms == res.eager.iter_ms and not res.eager.host.synced
    assert benchmark_modes(lambda: None, config=cfg, device="cpu", host_time=False).eager.host \
        is None
    assert benchmark(lambda: None, config=cfg, device="cpu").host is None
    with pytest.raises(ValueError, match="timing"):
        benchmark_modes(lambda: None, timing="replay", config=cfg, device="cpu")
    with pytest.raises(ValueError, match="host_rounds"):
        TimingConfig(host_rounds=0)


# ----------------------------------------------------------------------------- bench runs

COMMON = ["--shapes", "smoke", "--device", "cpu", "--warmup", "1", "--windows", "2",
          "--iters", "1", "--no-plots", "--no-ceilings"]


def test_cpu_run_timing_both_writes_host_ms(tmp_path, capsys):
    out = tmp_path / "bench"
    assert cli.run(_parse([*COMMON, "--providers", "torch", "--timing", "both",
                           "--out", str(out)])) == 0
    rows = report.read_cases_csv(out / "cases.csv")
    assert [(r["mode"], r["timing_method"]) for r in rows] == [("fwd", "cpu"), ("fwdbwd", "cpu")]
    for r in rows:  # on the CPU the host time of a call is its wall time
        assert r["host_ms"] == pytest.approx(r["iter_ms"], rel=1e-5) and r["host_ms"] > 0
    data = json.loads((out / "results.json").read_text())
    assert data["timing"]["mode"] == "both" and data["timing"]["host_rounds"] == 3
    assert all(c["host_ms"] > 0 for c in data["cases"])
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.startswith("provider"))
    assert "graph ms" in header and "eager ms" in header and "host ms" in header
    line = next(line for line in table if line.startswith("torch "))
    assert line.split()[5] == "-"  # no graph figure on the CPU


def _fake_modes(step, *, timing, config, **kw):
    """A stand-in of benchmark_modes with GPU-like results: fwd captured (1 ms graph, 1.5 ms
    eager, 0.4 ms host); fwdbwd not capturable, its eager calls synchronising."""
    assert timing == "both"

    def result(ms, method, host=None, reason=""):
        stats = WindowStats(iter_ms=ms, min_ms=ms * 0.9, max_ms=ms * 1.1,
                            window_ms=(ms,) * config.num_windows)
        return TimingResult(stats=stats, method=method, fallback_reason=reason, config=config,
                            host=host)

    if _fake_modes.mode == "fwd":
        return ModeResults(graph=result(1.0, "cuda_graph"),
                           eager=result(1.5, "cuda_eager", HostTime(ms=0.4, calls=2, rounds=3)))
    reason = "capture failed: RuntimeError: forced"
    return ModeResults(graph=None, graph_reason=reason,
                       eager=result(3.0, "cuda_eager", HostTime(ms=math.nan, synced=True),
                                    reason))


def test_graph_and_eager_rows_side_by_side(tmp_path, capsys, monkeypatch):
    """The rows, files, table and markdown of a run timed both ways (GPU-like results from a
    stand-in timer: the harness around it is the real one)."""
    real_run_case = cli.run_case

    def run_case(ctx, provider, inputs, row, y_ref):
        _fake_modes.mode = row.mode
        return real_run_case(ctx, provider, inputs, row, y_ref)

    monkeypatch.setattr(cli, "benchmark_modes", _fake_modes)
    monkeypatch.setattr(cli, "run_case", run_case)
    out = tmp_path / "bench"
    assert cli.run(_parse([*COMMON, "--providers", "distmoe", "torch", "--out", str(out)])) == 0
    printed = capsys.readouterr().out
    rows = report.read_cases_csv(out / "cases.csv")
    got = [(r["provider"], r["mode"], r["timing_method"], r["iter_ms"], r["host_ms"])
           for r in rows]
    assert got == [
        ("distmoe", "fwd", "cuda_graph", 1.0, None),
        ("distmoe", "fwd", "cuda_eager", 1.5, 0.4),
        ("torch", "fwd", "cuda_graph", 1.0, None),
        ("torch", "fwd", "cuda_eager", 1.5, 0.4),
        ("distmoe", "fwdbwd", "cuda_eager", 3.0, None),
        ("torch", "fwdbwd", "cuda_eager", 3.0, None),
    ]
    assert rows[0]["tflops"] == pytest.approx(1.5 * rows[1]["tflops"], rel=1e-4)  # per figure
    for r in rows[4:]:
        assert "graph: n/a (capture failed: RuntimeError: forced)" in r["note"]
        assert "host: sync" in r["note"]
    assert "graph: n/a" not in rows[1]["note"] and "host: sync" not in rows[1]["note"]
    data = json.loads((out / "results.json").read_text())
    assert [c["host_ms"] for c in data["cases"]] == [None, 0.4, None, 0.4, None, None]
    assert [len(c["window_ms"]) for c in data["cases"]] == [2] * 6
    # the table: one line per case, graph, eager and host side by side
    lines = [line.split() for line in printed.splitlines()
             if line.startswith(("distmoe ", "torch "))]
    assert [cells[:8] for cells in lines] == [
        ["distmoe", "smoke", "64", "fwd", "1", "1.000", "1.500", "0.400"],
        ["torch", "smoke", "64", "fwd", "1", "1.000", "1.500", "0.400"],
        ["distmoe", "smoke", "64", "fwdbwd", "1", "n/a", "3.000", "sync"],
        ["torch", "smoke", "64", "fwdbwd", "1", "n/a", "3.000", "sync"],
    ]
    fwdbwd = next(line for line in printed.splitlines() if line.startswith("distmoe ")
                  and " fwdbwd " in line)
    assert fwdbwd.endswith("ok; graph: n/a (capture failed: RuntimeError: forced)")
    assert "of 4 cases failed" not in printed
    # markdown: eager columns, ratios within one timing
    text = report.markdown_tables([out / "results.json"])
    assert "| distmoe graph ms | torch graph ms | graph ratio |" in text
    table = [[c.strip() for c in ln.strip("|").split("|")]
             for ln in text.splitlines() if ln.startswith("| `")]
    assert [r[5:15] for r in table] == [
        ["1.000", "1.000", "1.00x", table[0][8], table[0][9], "1.500", "1.500", "1.00x",
         "0.400", "0.400"],
        ["n/a", "n/a", "-", table[1][8], table[1][9], "3.000", "3.000", "1.00x", "sync",
         "sync"],
    ]
    assert "CUDA-graph replay and eager calls" in text


# ----------------------------------------------------------------------------- markdown


def _case(provider, mode="fwd", **kw):
    case = dict(provider=provider, status="ok", shape="dense-e32", tokens=8192, hidden=4096,
                ffn=2048, num_experts=32, top_k=8, ep_size=2, imbalance=1.0, precision="bf16",
                mode=mode, routing="exact", timing_method="cuda_graph", iter_ms=2.0,
                tflops=500.0, pct_dense=70.0, pct_dense_sustained=80.0)
    case.update(kw)
    return case


def _write(tmp_path, name, cases, timing=None, date="2026-12-06T10:00:00+00:00"):
    path = tmp_path / name
    env = dict(gpu="NVIDIA H100", gpus=[{}], torch="2.11", triton="3.6", git_sha="abc",
               date_utc=date, command="python -m distmoe bench")
    path.write_text(json.dumps(dict(environment=env, cases=cases, timing=timing or dict(
        num_warmup=10, num_windows=5, iters_per_window=30, use_cuda_graph=True))))
    return path


def _table(text):
    return [[c.strip() for c in ln.strip("|").split("|")]
            for ln in text.splitlines() if ln.startswith("| ")]


def test_markdown_eager_columns_ratio_within_one_timing(tmp_path):
    """torch at EP > 1 cannot be captured: its eager figure is compared with distmoe's eager
    figure, never with distmoe's graph figure."""
    path = _write(tmp_path, "new.json", [
        _case("distmoe", iter_ms=2.0),
        _case("distmoe", timing_method="cuda_eager", iter_ms=2.5, host_ms=0.3),
        _case("torch", timing_method="cuda_eager", iter_ms=5.0, host_ms=None,
              note="graph: n/a (provider synchronises with the host); host: sync (...)"),
    ], timing=dict(num_warmup=10, num_windows=5, iters_per_window=30, use_cuda_graph=True,
                   mode="both", host_rounds=3))
    titles, row = _table(report.markdown_tables([path]))
    assert titles == ["shape", "T, D, F, E, K", "EP", "mode", "routing", "distmoe graph ms",
                      "torch graph ms", "graph ratio", "TFLOP/s", "% dense (sustained)",
                      "distmoe eager ms", "torch eager ms", "eager ratio", "distmoe host ms",
                      "torch host ms", "source"]
    assert row[5:] == ["2.000", "n/a", "-", "500", "70 (80)", "2.500", "5.000", "2.00x",
                       "0.300", "sync", "[1]"]


def test_old_results_files_render_as_before(tmp_path):
    """Files from before --timing (no host_ms, no timing mode) keep their table; an old
    file's eager fallback is an eager figure (no ratio against a graph figure), its host
    time blank."""
    old = _write(tmp_path, "old.json", [_case("distmoe"), _case("torch", iter_ms=3.0)])
    text = report.markdown_tables([old])
    titles, row = _table(text)
    assert titles == ["shape", "T, D, F, E, K", "EP", "mode", "routing", "distmoe ms",
                      "torch ms", "ratio", "TFLOP/s", "% dense (sustained)", "source"]
    assert row[5:] == ["2.000", "3.000", "1.50x", "500", "70 (80)", "[1]"]
    assert "Ratio = torch time / distmoe time." in text
    fallback = _write(tmp_path, "fallback.json", [
        _case("distmoe"),
        _case("torch", timing_method="cuda_eager", iter_ms=5.0,
              note="eager timing: provider synchronises with the host"),
    ])
    titles, row = _table(report.markdown_tables([fallback]))
    assert row[5:] == ["2.000", "-", "-", "500", "70 (80)", "-", "5.000", "-", "-", "-", "[1]"]
    # cases.csv of an older run (no host_ms column) reads back with host_ms None
    csv_path = tmp_path / "cases.csv"
    columns = [c for c in report.CASE_COLUMNS if c != "host_ms"]
    report.write_csv(csv_path, [_case("torch")], columns)
    assert report.read_cases_csv(csv_path)[0]["host_ms"] is None
    # and an old results.json's cases still make table lines (--replot)
    cases = [report.CaseResult(**c) for c in json.loads(old.read_text())["cases"]]
    lines = report.format_table(cases).splitlines()
    assert lines[2].split()[5:8] == ["2.000", "-", "-"]
