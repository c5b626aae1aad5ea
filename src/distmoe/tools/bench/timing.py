"""Iteration timing: warm-ups, then windows of iterations replayed from a CUDA graph.

Method (specification seed 002, section 07):

1. ``num_warmup`` eager calls (on a side stream, which CUDA-graph capture needs anyway).
2. Capture ``capture_iters`` calls into one CUDA graph (default: a whole window of 30, so one
   replay is one window; ``capture_iters=1`` replays a one-call graph 30 times).
3. ``num_windows`` windows; each window is timed with a pair of CUDA events around its
   replays. Multi-rank runs put a barrier before each window so that ranks start together.
4. Per-window time / iterations per window = per-iteration time of that window on this rank.
5. Maximum over ranks per window (``all_reduce(MAX)`` over the given process group), then the
   median over windows is the reported iteration time; the minimum and maximum window are the
   reported range (an observed range, not a confidence interval).

When capture is impossible (the function synchronises with the host, as the torch EP>1
baseline does with its split sizes, or capture raises), the same windows are timed eagerly
with CUDA events; on a machine without CUDA they are timed with ``time.perf_counter``. The
method used and the reason for a fallback are recorded in the result. Step 5 is a pure function
(:func:`reduce_windows`) so it can be tested without a device.

Sync points: one device synchronisation per window boundary and one barrier per window when
a multi-rank group is given; none inside a window.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from .telemetry import GpuTelemetry, Telemetry

TimingMethod = Literal["cuda_graph", "cuda_eager", "cpu"]


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How many calls to make and how to group them.

    Attributes:
        num_warmup: eager calls before any timing (compilation, autotuning, allocator warm-up).
        num_windows: timed windows; the median window is reported.
        iters_per_window: calls per window; window time is divided by it.
        capture_iters: calls captured into one CUDA graph; must divide ``iters_per_window``.
        use_cuda_graph: try CUDA-graph capture at all (``False``: eager CUDA events).
        telemetry: sample the GPU's SM clock and power while the timed windows run
            (:mod:`~distmoe.tools.bench.telemetry`; CUDA with ``nvidia-smi`` only).
    """

    num_warmup: int = 10
    num_windows: int = 5
    iters_per_window: int = 30
    capture_iters: int = 30
    use_cuda_graph: bool = True
    telemetry: bool = True

    def __post_init__(self) -> None:
        for name in ("num_warmup", "num_windows", "iters_per_window", "capture_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup ({self.num_warmup}) must be >= 0")
        if self.num_windows < 1 or self.iters_per_window < 1 or self.capture_iters < 1:
            raise ValueError(
                "num_windows, iters_per_window and capture_iters must be >= 1, got "
                f"{self.num_windows}, {self.iters_per_window}, {self.capture_iters}"
            )
        if self.iters_per_window % self.capture_iters:
            raise ValueError(
                f"capture_iters ({self.capture_iters}) must divide iters_per_window "
                f"({self.iters_per_window})"
            )


@dataclass(frozen=True, kw_only=True)
class WindowStats:
    """Reduced window times, all in milliseconds per iteration.

    Attributes:
        iter_ms: median over windows of the slowest rank's window.
        min_ms, max_ms: fastest and slowest window (after the max over ranks).
        window_ms: per-window time (after the max over ranks), in window order.
    """

    iter_ms: float
    min_ms: float
    max_ms: float
    window_ms: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class TimingResult:
    """Outcome of :func:`benchmark`.

    Attributes:
        stats: reduced window times.
        method: ``"cuda_graph"``, ``"cuda_eager"`` or ``"cpu"``.
        fallback_reason: why CUDA-graph timing was not used ("" when it was, or on CPU).
        config: the timing configuration.
        telemetry: this rank's GPU clock and power over the timed windows, or ``None``
            (CPU timing, telemetry off, or no ``nvidia-smi``).
    """

    stats: WindowStats
    method: TimingMethod
    fallback_reason: str
    config: TimingConfig
    telemetry: Telemetry | None = None

    @property
    def iter_ms(self) -> float:
        return self.stats.iter_ms


# ----------------------------------------------------------------------------- pure statistics


def per_iteration_ms(window_total_ms: Sequence[float], iters_per_window: int) -> list[float]:
    """Window totals (ms) divided by the iterations of a window."""
    if iters_per_window < 1:
        raise ValueError(f"iters_per_window ({iters_per_window}) must be >= 1")
    return [float(t) / iters_per_window for t in window_total_ms]


def max_over_ranks(per_rank_window_ms: Sequence[Sequence[float]]) -> list[float]:
    """Element-wise maximum over ranks: ``out[w] = max_r per_rank_window_ms[r][w]``."""
    if not per_rank_window_ms:
        raise ValueError("per_rank_window_ms must hold at least one rank")
    num_windows = len(per_rank_window_ms[0])
    if num_windows == 0 or any(len(r) != num_windows for r in per_rank_window_ms):
        raise ValueError(
            "every rank must report the same, non-zero number of windows, got "
            f"{[len(r) for r in per_rank_window_ms]}"
        )
    return [max(float(r[w]) for r in per_rank_window_ms) for w in range(num_windows)]


def reduce_windows(per_rank_window_ms: Sequence[Sequence[float]]) -> WindowStats:
    """Seed method: maximum over ranks per window, then median over windows, plus range.

    Args:
        per_rank_window_ms: ``[rank][window]`` milliseconds per iteration.
    """
    windows = max_over_ranks(per_rank_window_ms)
    return WindowStats(
        iter_ms=float(statistics.median(windows)),
        min_ms=min(windows),
        max_ms=max(windows),
        window_ms=tuple(windows),
    )


# ----------------------------------------------------------------------------- measurement


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _reduce_device(group: dist.ProcessGroup) -> torch.device:
    """Device on which a collective over ``group`` accepts tensors (gloo: CPU)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _allreduce_max(values: list[float], group: dist.ProcessGroup | None) -> list[list[float]]:
    """``[[max over ranks per entry]]`` in the ``[rank][window]`` shape of reduce_windows."""
    if _group_size(group) == 1:
        return [values]
    t = torch.tensor(values, dtype=torch.float64, device=_reduce_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [t.cpu().tolist()]


def _all_ranks_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    if _group_size(group) == 1:
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_reduce_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _group_size(group) > 1:
        dist.barrier(group=group)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _time_cpu(fn: Callable[[], object], cfg: TimingConfig, group) -> list[float]:
    for _ in range(cfg.num_warmup):
        fn()
    totals = []
    for _ in range(cfg.num_windows):
        _barrier(group)
        start = time.perf_counter()
        for _ in range(cfg.iters_per_window):
            fn()
        totals.append((time.perf_counter() - start) * 1e3)
    return per_iteration_ms(totals, cfg.iters_per_window)


def _capture(fn: Callable[[], object], iters: int, pool=None) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(iters):
            fn()
    graph.replay()  # one validating replay; errors surface here rather than mid-window
    torch.cuda.synchronize()
    return graph


def _clear_rng_capture_state() -> None:
    """After a capture that raised, the device's default CUDA generator can stay marked as
    capturing (torch ends the stream's capture but not the generator's), and every later
    random op on the device then fails with "Offset increment outside graph capture
    encountered unexpectedly" (seen in a bench-tool test after the eager-fallback one). A
    trivial capture that ends normally ends the generator's capture too."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.empty(1, device="cuda").zero_()
        del graph
    except Exception:  # nothing more to do here: the fallback's timing does not need it
        pass


def _warm_up_on_side_stream(fns: Sequence[Callable[[], object]], calls: int) -> None:
    """``calls`` eager calls of each function on a side stream, then a device sync: capture
    requires that lazy initialisation (cuBLAS handles and workspaces, Triton compilation,
    autograd streams) happened off the capture stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _time_cuda(
    fn: Callable[[], object], cfg: TimingConfig, group, graph_safe: bool
) -> tuple[list[float], TimingMethod, str, Telemetry | None]:
    _warm_up_on_side_stream([fn], cfg.num_warmup)

    graph, reason = None, ""
    if not cfg.use_cuda_graph:
        reason = "CUDA graphs disabled"
    elif not graph_safe:
        reason = "provider synchronises with the host"
    else:
        try:
            graph = _capture(fn, cfg.capture_iters)
        except Exception as exc:  # capture failures are data, not errors of the harness
            graph, reason = None, "capture failed: " + _first_line(exc)
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
            _clear_rng_capture_state()
    # A collective inside fn must run the same way on every rank.
    if not _all_ranks_agree(graph is not None, group) and graph is not None:
        graph, reason = None, "capture failed on another rank"

    step = graph.replay if graph is not None else fn
    calls = cfg.iters_per_window // cfg.capture_iters if graph is not None else cfg.iters_per_window
    events = []
    telemetry = GpuTelemetry(torch.device("cuda", torch.cuda.current_device())
                             if cfg.telemetry else None)
    with telemetry:
        for _ in range(cfg.num_windows):
            _barrier(group)
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                step()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
    totals = [s.elapsed_time(e) for s, e in events]
    del graph
    method: TimingMethod = "cuda_graph" if not reason else "cuda_eager"
    return per_iteration_ms(totals, cfg.iters_per_window), method, reason, telemetry.summary()


def benchmark(
    fn: Callable[[], object],
    *,
    config: TimingConfig | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    graph_safe: bool = True,
) -> TimingResult:
    """Time ``fn()`` with the seed's window method and reduce over the ranks of ``group``.

    Args:
        fn: one iteration (no arguments; its result is discarded). Inputs must live at stable
            addresses for graph replay.
        config: counts of warm-ups, windows and iterations.
        group: ranks over which to take the per-window maximum (every rank must call).
        device: ``"cuda"``/CUDA device for CUDA timing, anything else (or no CUDA) times on
            the host with ``time.perf_counter``. Default: CUDA when available.
        graph_safe: ``False`` skips capture for functions known to synchronise with the host.
    """
    cfg = config or TimingConfig()
    if device is None:
        use_cuda = torch.cuda.is_available()
    else:
        use_cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    telemetry = None
    if use_cuda:
        local, method, reason, telemetry = _time_cuda(fn, cfg, group, graph_safe)
    else:
        local, method, reason = _time_cpu(fn, cfg, group), "cpu", ""
    stats = reduce_windows(_allreduce_max(local, group))
    return TimingResult(stats=stats, method=method, fallback_reason=reason, config=cfg,
                        telemetry=telemetry)


# ----------------------------------------------------------------------- interleaved comparison


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round of :func:`interleaved`: ``names`` rotated by one per round, so
    that every candidate runs first, last and beside every other as often as ``rounds``
    allows (clock and power drift then hits them alike)."""
    names = list(names)
    if rounds < 1:
        raise ValueError(f"rounds ({rounds}) must be >= 1")
    if not names:
        return [[] for _ in range(rounds)]
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 7, iters: int = 20,
                warmup: int = 3, device: torch.device | str | None = None,
                group: dist.ProcessGroup | None = None,
                share_pool: bool = False) -> dict[str, WindowStats]:
    """Time several functions against each other, one window of each per round.

    Each ``fns[name]()`` is warmed up, captured ``iters`` times into one CUDA graph (on CPU:
    called ``iters`` times), and every round replays each graph once between CUDA events,
    in the rotating order of :func:`round_orders`. A single GPU's clock falls as it heats
    and rises when it idles; timing candidates one after the other lets that drift decide
    a comparison of a few per cent, and interleaving does not. Returns, per name, the median
    over rounds of the per-call time (ms) and the fastest and slowest round
    (:class:`WindowStats`; ``window_ms`` in round order). With a multi-rank ``group`` every
    rank calls it with the same names in the same order (the functions' own collectives
    keep the ranks together), and each round is the slowest rank's, as in
    :func:`benchmark` (:func:`reduce_windows`). ``share_pool``: capture every graph into
    one memory pool (``torch.cuda.graph_pool_handle``) instead of one pool each, for
    functions whose temporaries are large and whose results nobody reads after the round
    (the graphs never run at once, so each overwrites only dead memory of the others).
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters ({iters}) must be >= 1 and warmup ({warmup}) >= 0")
    orders = round_orders(list(fns), rounds)
    use_cuda = torch.cuda.is_available() and (device is None
                                              or torch.device(device).type == "cuda")
    steps: dict[str, Callable[[], object]] = {}
    if use_cuda:
        _warm_up_on_side_stream(list(fns.values()), warmup)
        pool = torch.cuda.graph_pool_handle() if share_pool else None
        steps = {name: _capture(fn, iters, pool).replay for name, fn in fns.items()}
    else:
        for name, fn in fns.items():
            for _ in range(warmup):
                fn()
            steps[name] = (lambda fn=fn: [fn() for _ in range(iters)])
    times: dict[str, list[float]] = {name: [] for name in fns}
    for order in orders:
        for name in order:
            if use_cuda:
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                steps[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                steps[name]()
                times[name].append((time.perf_counter() - t0) * 1e3 / iters)
    return {name: reduce_windows(_allreduce_max(ms, group)) for name, ms in times.items()}
