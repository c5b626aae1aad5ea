"""GPU clock and power telemetry of the benchmark (``distmoe.tools.bench.telemetry``)."""

import shutil

import pytest
import torch

from distmoe.tools.bench.telemetry import GpuTelemetry, parse_samples
from distmoe.tools.bench.timing import TimingConfig, benchmark


def test_parse_samples_keeps_well_formed_lines_only():
    lines = ["1980, 690.51", " 1755 , 702.1 ", "[N/A], 300.0", "1500, [N/A]", "", "garbage",
             "1, 2, 3", "No devices were found"]
    assert parse_samples(lines) == [(1980.0, 690.51), (1755.0, 702.1)]


@pytest.mark.parametrize("device", [None, "cpu"])
def test_no_cuda_device_records_nothing(device):
    with GpuTelemetry(device) as tel:
        sum(range(1000))
    assert tel.summary() is None


def test_cpu_timing_has_no_telemetry():
    res = benchmark(lambda: sum(range(100)), config=TimingConfig(num_warmup=0, num_windows=2,
                                                                  iters_per_window=2,
                                                                  capture_iters=1),
                    device="cpu")
    assert res.method == "cpu" and res.telemetry is None


@pytest.mark.gpu
def test_gpu_telemetry_samples_a_busy_gpu():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    res = benchmark(lambda: a @ a, config=TimingConfig(num_warmup=2, num_windows=5,
                                                       iters_per_window=200,
                                                       capture_iters=50))
    tel = res.telemetry
    assert tel is not None and tel.samples >= 1
    assert 100 < tel.sm_clock_mhz < 5000, tel
    assert 10 < tel.power_w < 2000, tel


def test_ceiling_keeps_the_clock_of_its_best_measurement_and_the_table_shows_it():
    from distmoe.tools.bench import report
    from distmoe.tools.bench.ceilings import Ceiling, _record
    from distmoe.tools.bench.telemetry import Telemetry
    from distmoe.tools.bench.timing import TimingResult, WindowStats

    def result(ms, telemetry):
        stats = WindowStats(iter_ms=ms, min_ms=ms, max_ms=ms, window_ms=(ms,))
        return TimingResult(stats=stats, method="cuda_graph", fallback_reason="",
                            config=TimingConfig(), telemetry=telemetry)

    c = Ceiling(name="dense_bf16_sustained", unit="TFLOP/s")
    _record(c, "a", 600.0, result(1.0, Telemetry(sm_clock_mhz=1500.0, power_w=690.0,
                                                    samples=9)))
    _record(c, "b", 500.0, result(1.2, Telemetry(sm_clock_mhz=1980.0, power_w=300.0,
                                                    samples=9)))  # slower: not kept
    assert (c.value, c.detail, c.sm_clock_mhz, c.power_w) == (600.0, "a", 1500.0, 690.0)
    text = report.format_table([], [c.__dict__, {"name": "device_copy", "value": None,
                                                 "unit": "GB/s", "note": "no GPU"}])
    assert "ceiling dense_bf16_sustained" in text and "a (1500 MHz, 690 W)" in text
    assert text.splitlines()[-1].endswith("GB/s     no GPU")
