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


def test_eager_fallback_is_recorded():
    # last in the file: a refused capture (host sync) must fall back, not fail
    res = benchmark(lambda: torch.ones(8, device="cuda").sum().item(), config=TINY, device="cuda")
    assert res.method == "cuda_eager" and res.fallback_reason.startswith("capture failed")
    # the failed capture left the device's random number generator usable (run 43: it did not)
    assert torch.isfinite(torch.randn(4, device="cuda")).all()
