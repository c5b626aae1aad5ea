"""GPU checks of the benchmark harness (skipped without CUDA): the baseline's fast path and its
numerics on the device, CUDA-graph capture of its iterations, and tiny ceilings/micro runs.

No timing values are asserted, only that measurements exist and which method ran.
"""

import math

import pytest
import torch
from test_bench_baseline import loop_reference, make_case

from distmoe.tools.bench import baseline, ceilings, micro
from distmoe.tools.bench.providers import make_step
from distmoe.tools.bench.timing import TimingConfig, benchmark
from distmoe.tools.bench.workloads import SHAPES, make_layer_inputs

pytestmark = pytest.mark.gpu

TINY = TimingConfig(num_warmup=2, num_windows=2, iters_per_window=4, capture_iters=4)


def test_grouped_mm_fast_path_on_cuda():
    path, reason = baseline.grouped_mm_path("cuda", torch.bfloat16)
    assert path == "grouped_mm", reason


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_baseline_cuda_matches_loop(path):
    # bf16 tolerance as in test_bench_baseline: a few bf16 roundings of the intermediates
    x, ids, scores, w13, w2, grad_y = make_case(
        37, 64, 32, 6, 2, torch.bfloat16, inactive=((3, 1),)
    )
    dev = [t.cuda() for t in (x, ids, scores, w13, w2)]
    y = baseline.torch_moe(*dev, path=path)
    y_ref = loop_reference(x.double(), ids, scores.double(), w13.double(), w2.double())
    err = (y.cpu().double() - y_ref).abs().max() / y_ref.abs().max()
    assert err < 3e-2


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_torch_baseline_is_captured_in_a_cuda_graph(mode):
    inputs = make_layer_inputs(SHAPES["smoke"], tokens=64, training=mode == "fwdbwd", device="cuda")
    path = baseline.grouped_mm_path("cuda")[0]
    step = make_step(lambda *a: baseline.torch_moe(*a, path=path), inputs, mode)
    res = benchmark(step, config=TINY, device="cuda")
    assert res.method == "cuda_graph", res.fallback_reason
    assert len(res.stats.window_ms) == 2 and res.iter_ms > 0


def test_tiny_ceilings_and_micro():
    dev = torch.device("cuda")
    dense = ceilings.dense_bf16(dev, TINY, shapes=((512, 512, 512),))
    assert dense.value and dense.value > 0 and dense.method == "cuda_graph"
    sustained = ceilings.dense_bf16_sustained(dev, TINY, window_ms=1.0, shape=(512, 512, 512))
    assert sustained.value and sustained.value > 0 and sustained.method == "cuda_graph"
    copy = ceilings.device_copy(dev, TINY, nbytes=1 << 24)
    assert copy.value and copy.value > 0
    read = ceilings.device_read(dev, TINY, nbytes=1 << 24)
    assert read.value and read.value > 0 and read.method == "cuda_graph", read.note
    rows, crossings = micro.grouped_vs_bmm(dev, TINY, widths=(256,), total_rows=(1024, 2048))
    assert len(rows) == 4 and all(math.isfinite(r.tflops) for r in rows)
    assert set(crossings) == {256}
    proj = micro.matched_projection(dev, TINY, tokens=(16,), d_in=256, d_out=1024, splits=(4,))
    assert [r.provider for r in proj] == ["dense", "grouped_4"]
    assert "bitwise equal" in proj[1].note


def test_graph_and_eager_with_host_time():
    """--timing both on the device: a graph figure, an eager figure and a host time per call
    issued ahead of the GPU (the torch baseline does not wait for the GPU at EP = 1)."""
    from distmoe.tools.bench.timing import CudaSleep, benchmark_modes

    inputs = make_layer_inputs(SHAPES["smoke"], tokens=64, training=False, device="cuda")
    path = baseline.grouped_mm_path("cuda")[0]
    step = make_step(lambda *a: baseline.torch_moe(*a, path=path), inputs, "fwd")
    res = benchmark_modes(step, timing="both", config=TINY, device="cuda")
    assert res.graph is not None and res.graph.method == "cuda_graph", res.graph_reason
    assert res.eager is not None and res.eager.method == "cuda_eager"
    assert len(res.eager.stats.window_ms) == 2 and res.eager.iter_ms > 0
    host = res.eager.host
    assert host is not None and not host.synced and 0 < host.ms < 1000, host
    only = benchmark_modes(step, timing="eager", config=TINY, device="cuda")
    assert only.graph is None and only.graph_reason == "" and only.eager.host is not None
    # the calibrated sleep lasts about as long as asked
    sleeper = CudaSleep()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    done = sleeper.sleep(20.0)
    end.record()
    assert not done()  # queried at once: still sleeping
    end.synchronize()
    assert 5.0 < start.elapsed_time(end) < 80.0
    assert done()


def test_host_time_of_a_synchronising_function_is_sync():
    """A function that reads a value back (.item()) waits for the queued sleep: its host time
    is reported as sync, not as the sleep's length; no graph is tried (graph_safe False)."""
    from distmoe.tools.bench.timing import benchmark_modes

    res = benchmark_modes(lambda: torch.ones(8, device="cuda").sum().item(), timing="both",
                          config=TINY, device="cuda", graph_safe=False)
    assert res.graph is None and res.graph_reason == "provider synchronises with the host"
    assert res.eager.method == "cuda_eager" and res.eager.host.synced
    assert math.isnan(res.eager.host.ms)


def test_eager_fallback_is_recorded():
    # last in the file: a refused capture (host sync) must fall back, not fail
    res = benchmark(lambda: torch.ones(8, device="cuda").sum().item(), config=TINY, device="cuda")
    assert res.method == "cuda_eager" and res.fallback_reason.startswith("capture failed")
    # the failed capture left the device's random number generator usable (run 43: it did not)
    assert torch.isfinite(torch.randn(4, device="cuda")).all()
