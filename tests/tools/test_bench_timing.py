"""Window statistics of the timing harness (pure functions) and the CPU timing path."""

import time

import pytest

from distmoe.tools.bench.timing import (
    TimingConfig,
    benchmark,
    interleaved,
    max_over_ranks,
    per_iteration_ms,
    reduce_windows,
    round_orders,
)


def test_per_iteration_divides_window_totals():
    assert per_iteration_ms([30.0, 60.0, 45.0], 30) == [1.0, 2.0, 1.5]
    with pytest.raises(ValueError, match="iters_per_window"):
        per_iteration_ms([1.0], 0)


def test_max_over_ranks_is_per_window():
    per_rank = [[1.0, 5.0, 3.0], [2.0, 4.0, 3.5]]
    assert max_over_ranks(per_rank) == [2.0, 5.0, 3.5]
    with pytest.raises(ValueError, match="same"):
        max_over_ranks([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError, match="at least one rank"):
        max_over_ranks([])


def test_reduce_windows_median_of_rank_maxima_and_range():
    # rank maxima per window: [2, 2, 3, 9, 5] -> median 3, range 2..9
    stats = reduce_windows([[1, 2, 3, 4, 5], [2, 1, 3, 9, 0]])
    assert stats.window_ms == (2.0, 2.0, 3.0, 9.0, 5.0)
    assert stats.iter_ms == 3.0
    assert (stats.min_ms, stats.max_ms) == (2.0, 9.0)


def test_reduce_windows_median_not_max_of_medians():
    # per-rank medians are 3 and 3, but the slowest rank per window gives [9, 9, 3] -> 9
    stats = reduce_windows([[9, 1, 3], [1, 9, 3]])
    assert stats.window_ms == (9.0, 9.0, 3.0)
    assert stats.iter_ms == 9.0


def test_reduce_windows_even_count_and_single_rank():
    stats = reduce_windows([[4.0, 1.0, 2.0, 3.0]])
    assert stats.iter_ms == 2.5  # median of an even count averages the middle two
    assert (stats.min_ms, stats.max_ms) == (1.0, 4.0)


def test_timing_config_validation():
    with pytest.raises(ValueError, match="capture_iters"):
        TimingConfig(iters_per_window=30, capture_iters=7)
    with pytest.raises(ValueError, match=">= 1"):
        TimingConfig(num_windows=0)
    with pytest.raises(TypeError, match="num_warmup"):
        TimingConfig(num_warmup=1.5)
    assert TimingConfig().capture_iters == TimingConfig().iters_per_window == 30


def test_cpu_benchmark_counts_calls_and_records_method():
    calls = []
    cfg = TimingConfig(num_warmup=2, num_windows=3, iters_per_window=4, capture_iters=4)
    res = benchmark(lambda: calls.append(1), config=cfg, device="cpu")
    assert len(calls) == 2 + 3 * 4
    assert res.method == "cpu"
    assert res.fallback_reason == ""
    assert len(res.stats.window_ms) == 3
    assert res.stats.min_ms <= res.iter_ms <= res.stats.max_ms


def test_copy_and_read_ceilings_run_on_cpu():
    # The ceilings' own code (not only their timing) runs here; the GPU test checks values.
    import torch

    from distmoe.tools.bench import ceilings

    cfg = TimingConfig(num_warmup=1, num_windows=2, iters_per_window=2, capture_iters=2)
    for fn in (ceilings.device_copy, ceilings.device_read):
        c = fn(torch.device("cpu"), cfg, nbytes=1 << 16)
        assert c.note == "" and c.value > 0 and c.method == "cpu", (c.name, c.note)


def test_sustained_dense_ceiling_runs_on_cpu():
    """Its code runs here (windows sized from a burst timing, whole multiples of 30
    iterations); the GPU test checks the value."""
    import re

    import torch

    from distmoe.tools.bench import ceilings

    cfg = TimingConfig(num_warmup=1, num_windows=2, iters_per_window=30, capture_iters=30)
    c = ceilings.dense_bf16_sustained(torch.device("cpu"), cfg, window_ms=5.0,
                                      shape=(32, 32, 32))
    assert c.note == "" and c.value > 0 and c.method == "cpu", c.note
    iters = int(re.fullmatch(r"32x32x32 x(\d+)/window", c.detail).group(1))
    assert iters >= 30 and iters % 30 == 0
    names = [x.name for x in ceilings.measure_all(torch.device("cpu"), cfg).items]
    assert "dense_bf16_sustained" in names


def test_round_orders_rotate_every_candidate_through_every_place():
    orders = round_orders(["a", "b", "c"], 4)
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    # each round runs each candidate once; over len(names) rounds each takes every place
    for r in range(3):
        assert sorted(orders[r]) == ["a", "b", "c"]
    assert {orders[r][0] for r in range(3)} == {"a", "b", "c"}
    assert round_orders([], 2) == [[], []]
    with pytest.raises(ValueError, match=r"rounds \(0\) must be >= 1"):
        round_orders(["a"], 0)


def test_interleaved_on_cpu_orders_calls_and_reduces_rounds():
    calls = []
    fns = {"slow": lambda: (calls.append("slow"), time.sleep(0.004)),
           "fast": lambda: calls.append("fast")}
    stats = interleaved(fns, rounds=3, iters=2, warmup=1, device="cpu")
    # warm-ups first, then per round each candidate's iters calls, in the rotating order
    assert calls == (["slow", "fast"] + ["slow"] * 2 + ["fast"] * 2 + ["fast"] * 2
                     + ["slow"] * 2 + ["slow"] * 2 + ["fast"] * 2)
    assert set(stats) == {"slow", "fast"}
    for s in stats.values():
        assert len(s.window_ms) == 3 and s.min_ms <= s.iter_ms <= s.max_ms
    assert stats["slow"].iter_ms >= 3.5 > stats["fast"].iter_ms
    with pytest.raises(ValueError, match=r"iters \(0\) must be >= 1"):
        interleaved(fns, iters=0, device="cpu")
