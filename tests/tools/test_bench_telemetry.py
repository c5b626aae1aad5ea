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
