"""NVLink bytes measured through NVML GPM (distmoe.tools.bench.nvlink): where it cannot
measure it says why (no GPU, one GPU, no NVML library) instead of reporting a number; the
per-direction mean; a two-rank CPU bench run notes the reason on its rows (every rank
decides together, so no rank runs measuring calls alone)."""

import pytest
import torch

from distmoe.tools.bench import nvlink


def test_reasons_without_two_gpus():
    counter, why = nvlink.open_counter(torch.device("cpu"))
    assert counter is None and why == "needs a CUDA GPU"
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        counter, why = nvlink.open_counter(torch.device("cuda", 0))
        assert counter is None and why.startswith("needs two visible GPUs")
    assert nvlink.counter_for(torch.device("cpu")) == (None, "needs a CUDA GPU")


def test_per_direction_is_the_mean():
    assert nvlink.LinkBytes(tx=3.0, rx=5.0).per_direction == 4.0


@pytest.mark.multigpu
def test_measures_on_two_gpus():
    dev = torch.device("cuda", 0)
    counter, why = nvlink.open_counter(dev)
    if counter is None:
        pytest.skip(why)
    src = torch.randn(64 << 20, device=dev)
    dst = torch.empty_like(src, device="cuda:1")
    link = counter.measure(lambda: dst.copy_(src), 4, dev)  # 256 MiB per call to GPU 1
    assert link.tx >= 0.5 * src.nbytes, link


def test_bench_rows_say_why_nothing_was_measured():
    """The bench's per-case step on CPU ranks: no counter, so no measuring call runs and
    every row of the case gets the reason in its note."""
    import argparse

    from distmoe.tools.bench import cli, report
    from distmoe.tools.bench.groups import BenchGroup

    plan = cli.resolve_plan(cli.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--device", "cpu", "--shapes", "smoke"]))
    ctx = cli._Context(plan=plan, device=torch.device("cpu"),
                       bench_group=BenchGroup(group=None, rank=0, world_size=2, owned=False),
                       dense_tflops=None)
    rows = [report.CaseResult(provider="distmoe", status="ok", shape="smoke", tokens=8,
                              hidden=64, ffn=32, num_experts=8, top_k=2, ep_size=2,
                              imbalance=1.0, precision="bf16", mode="fwd", iter_ms=1.0,
                              note="x")]
    calls = []
    cli._measure_nvlink(ctx, lambda: calls.append(1), rows, None)
    assert not calls and rows[0].nvlink_measured_gbps is None
    assert rows[0].note == "x; nvlink measured: n/a (needs a CUDA GPU)"
