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

Graph and eager (:func:`benchmark_modes`, ``python -m distmoe bench --timing``): users mostly
call the layer eagerly, so a case can be timed both ways after one warm-up: CUDA-graph replay
as above, and eager calls, the same windows of back-to-back calls between CUDA events, reduced
the same way. A function that cannot be captured has no graph figure (the reason is kept).

Host time per call (:func:`host_time_per_call`, eager timing only): a long GPU sleep
(``torch.cuda._sleep``, its cycles per millisecond calibrated once per device) is queued
first, so that the host never waits for the GPU while it issues ``n`` back-to-back calls,
timed with ``time.perf_counter`` and divided by ``n``; then a device synchronisation. An event
recorded after the sleep tells whether the sleep was still running when the last call
returned. If it was not, the sleep was too short, the launch queue filled, or the function
made the host wait for the GPU; the measurement is repeated with a longer sleep and fewer
calls, and a function whose calls still outlast the sleep (the first call waits for it: a
``.item()``, ``.tolist()``, a synchronisation) is reported as synchronising (``synced``, no
number) rather than with the sleep's length as its host time. On the CPU the host time of a
call is its wall time (the window times above).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from .telemetry import GpuTelemetry, Telemetry

TimingMethod = Literal["cuda_graph", "cuda_eager", "cpu"]
#: ``--timing`` of ``python -m distmoe bench``: what :func:`benchmark_modes` times.
TIMING_CHOICES: tuple[str, ...] = ("graph", "eager", "both")


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
        host_rounds: rounds of the host-time measurement (each behind its own GPU sleep);
            the median is reported.
    """

    num_warmup: int = 10
    num_windows: int = 5
    iters_per_window: int = 30
    capture_iters: int = 30
    use_cuda_graph: bool = True
    telemetry: bool = True
    host_rounds: int = 3

    def __post_init__(self) -> None:
        for name in ("num_warmup", "num_windows", "iters_per_window", "capture_iters",
                     "host_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup ({self.num_warmup}) must be >= 0")
        if (self.num_windows < 1 or self.iters_per_window < 1 or self.capture_iters < 1
                or self.host_rounds < 1):
            raise ValueError(
                "num_windows, iters_per_window, capture_iters and host_rounds must be >= 1, "
                f"got {self.num_windows}, {self.iters_per_window}, {self.capture_iters}, "
                f"{self.host_rounds}"
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
class HostTime:
    """Host time per call of eager calls (:func:`host_time_per_call`).

    Attributes:
        ms: host milliseconds per call, the median over rounds (the slowest rank's); NaN
            when ``synced``.
        synced: the calls made the host wait for the GPU: no host time can be given.
        calls: calls per round (of the last attempt).
        rounds: rounds measured (0 when ``synced``).
        sleep_ms: the GPU sleep queued ahead of the calls (of the last attempt; 0 on CPU).
    """

    ms: float
    synced: bool = False
    calls: int = 0
    rounds: int = 0
    sleep_ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class TimingResult:
    """Outcome of :func:`benchmark` (and each half of :func:`benchmark_modes`).

    Attributes:
        stats: reduced window times.
        method: ``"cuda_graph"``, ``"cuda_eager"`` or ``"cpu"``.
        fallback_reason: why CUDA-graph timing was not used ("" when it was, or on CPU).
        config: the timing configuration.
        telemetry: this rank's GPU clock and power over the timed windows, or ``None``
            (CPU timing, telemetry off, or no ``nvidia-smi``).
        host: host time per call (eager and CPU timing, when asked for), else ``None``.
    """

    stats: WindowStats
    method: TimingMethod
    fallback_reason: str
    config: TimingConfig
    telemetry: Telemetry | None = None
    host: HostTime | None = None

    @property
    def iter_ms(self) -> float:
        return self.stats.iter_ms


@dataclass(frozen=True, kw_only=True)
class ModeResults:
    """Outcome of :func:`benchmark_modes`.

    Attributes:
        graph: CUDA-graph replay (``None``: not asked for, not capturable, or no CUDA).
        eager: eager calls (``"cuda_eager"``, with host time) or the CPU timing (``"cpu"``);
            ``None`` only when graph timing alone was asked for and the capture worked.
        graph_reason: why there is no graph figure although one was asked for ("" else;
            also "" on the CPU, which has no CUDA graphs).
    """

    graph: TimingResult | None
    eager: TimingResult | None
    graph_reason: str = ""

    def results(self) -> list[TimingResult]:
        """The figures measured: graph first, then eager."""
        return [r for r in (self.graph, self.eager) if r is not None]


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


def all_ranks_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (one all-reduce; collective)."""
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


def _try_capture(
    fn: Callable[[], object], cfg: TimingConfig, group, graph_safe: bool
) -> tuple[torch.cuda.CUDAGraph | None, str]:
    """A graph of ``cfg.capture_iters`` calls of ``fn`` (warmed up already), or ``None`` and
    why not. Every rank of ``group`` gets a graph or none does."""
    graph, reason = None, ""
    if not graph_safe:
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
    if not all_ranks_agree(graph is not None, group) and graph is not None:
        graph, reason = None, "capture failed on another rank"
    return graph, reason


def _cuda_windows(
    step: Callable[[], object], calls: int, cfg: TimingConfig, group
) -> tuple[list[float], Telemetry | None, float]:
    """``cfg.num_windows`` windows of ``calls`` calls of ``step`` between CUDA events.

    Returns the per-iteration milliseconds of each window (window / ``iters_per_window``),
    the telemetry over the windows, and the host's wall milliseconds per iteration over all
    windows (device synchronised at both ends; an upper bound of the host's issue time)."""
    events = []
    telemetry = GpuTelemetry(torch.device("cuda", torch.cuda.current_device())
                             if cfg.telemetry else None)
    torch.cuda.synchronize()
    wall_start = time.perf_counter()
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
    wall_ms = (time.perf_counter() - wall_start) * 1e3
    totals = [s.elapsed_time(e) for s, e in events]
    wall_per_iter = wall_ms / (cfg.num_windows * cfg.iters_per_window)
    return per_iteration_ms(totals, cfg.iters_per_window), telemetry.summary(), wall_per_iter


def _result(local: list[float], method: TimingMethod, reason: str, cfg: TimingConfig, group,
            telemetry: Telemetry | None = None, host: HostTime | None = None) -> TimingResult:
    stats = reduce_windows(_allreduce_max(local, group))
    return TimingResult(stats=stats, method=method, fallback_reason=reason, config=cfg,
                        telemetry=telemetry, host=host)


def _use_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def benchmark_modes(
    fn: Callable[[], object],
    *,
    timing: str = "both",
    config: TimingConfig | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    graph_safe: bool = True,
    host_time: bool = True,
) -> ModeResults:
    """Time ``fn()`` under CUDA-graph replay, as eager calls, or both (``timing``: one of
    :data:`TIMING_CHOICES`), after one warm-up.

    Graph: as :func:`benchmark` (``config.use_cuda_graph`` is not read: ``timing`` decides).
    Eager: the same windows of ``iters_per_window`` back-to-back eager calls between CUDA
    events, the same reduction (maximum over ranks, median over windows), then
    (``host_time``) the host time per call, :func:`host_time_per_call` over
    ``config.host_rounds`` rounds. A function that cannot be captured gets its eager figure
    whatever ``timing`` says, and ``graph_reason`` says why there is no graph figure. Without
    CUDA (``device`` not CUDA) the windows are timed on the host (method ``"cpu"``), once,
    as the eager figure, and the host time of a call is its wall time (the median window).
    Every rank of ``group`` calls it with the same arguments.
    """
    cfg = config or TimingConfig()
    if timing not in TIMING_CHOICES:
        raise ValueError(f"timing ({timing!r}) must be one of {TIMING_CHOICES}")
    if not _use_cuda(device):
        res = _result(_time_cpu(fn, cfg, group), "cpu", "", cfg, group)
        if host_time:
            host = HostTime(ms=res.iter_ms, calls=cfg.iters_per_window, rounds=cfg.num_windows)
            res = dataclasses.replace(res, host=host)
        return ModeResults(graph=None, eager=res)

    _warm_up_on_side_stream([fn], cfg.num_warmup)
    graph_res, reason = None, ""
    if timing != "eager":
        graph, reason = _try_capture(fn, cfg, group, graph_safe)
        if graph is not None:
            local, telemetry, _ = _cuda_windows(
                graph.replay, cfg.iters_per_window // cfg.capture_iters, cfg, group)
            del graph
            graph_res = _result(local, "cuda_graph", "", cfg, group, telemetry)
    eager_res = None
    if timing != "graph" or graph_res is None:
        local, telemetry, wall_ms = _cuda_windows(fn, cfg.iters_per_window, cfg, group)
        host = None
        if host_time:
            host = host_time_per_call(fn, calls=cfg.iters_per_window, wall_ms_per_call=wall_ms,
                                      rounds=cfg.host_rounds, group=group)
        eager_res = _result(local, "cuda_eager", reason, cfg, group, telemetry, host)
    return ModeResults(graph=graph_res, eager=eager_res, graph_reason=reason)


def benchmark(
    fn: Callable[[], object],
    *,
    config: TimingConfig | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    graph_safe: bool = True,
    host_time: bool = False,
) -> TimingResult:
    """Time ``fn()`` with the seed's window method and reduce over the ranks of ``group``.

    Args:
        fn: one iteration (no arguments; its result is discarded). Inputs must live at stable
            addresses for graph replay.
        config: counts of warm-ups, windows and iterations; ``use_cuda_graph=False`` times
            eager calls only.
        group: ranks over which to take the per-window maximum (every rank must call).
        device: ``"cuda"``/CUDA device for CUDA timing, anything else (or no CUDA) times on
            the host with ``time.perf_counter``. Default: CUDA when available.
        graph_safe: ``False`` skips capture for functions known to synchronise with the host.
        host_time: also measure the host time per call where the timing is eager.

    Returns the graph figure, or, where capture was off or impossible, the eager one (its
    ``fallback_reason`` says why). :func:`benchmark_modes` gives both.
    """
    cfg = config or TimingConfig()
    res = benchmark_modes(fn, timing="graph" if cfg.use_cuda_graph else "eager", config=cfg,
                          group=group, device=device, graph_safe=graph_safe,
                          host_time=host_time)
    if res.graph is not None:
        return res.graph
    assert res.eager is not None
    if res.eager.method == "cuda_eager" and not cfg.use_cuda_graph:
        return dataclasses.replace(res.eager, fallback_reason="CUDA graphs disabled")
    return res.eager


# ----------------------------------------------------------------------------- host time

#: Bounds of the GPU sleep queued ahead of the calls of :func:`host_time_per_call` (ms).
MIN_HOST_SLEEP_MS = 20.0
MAX_HOST_SLEEP_MS = 2000.0
#: Attempts of one round before its calls count as synchronising.
HOST_ATTEMPTS = 4


class GpuQueue(Protocol):
    """What :func:`host_time_per_call` needs of a device (a fake one in tests)."""

    def sleep(self, ms: float) -> Callable[[], bool]:
        """Queue about ``ms`` milliseconds of device work ahead of what comes next; returns a
        check, ``True`` once that work has finished."""

    def synchronize(self) -> None:
        """Wait for all queued device work."""


class CudaSleep:
    """:class:`GpuQueue` of the current CUDA device and stream: ``torch.cuda._sleep`` (a
    kernel that spins for a number of clock cycles), sized from a calibration made once per
    device, and an event recorded after it."""

    CALIBRATION_CYCLES = 10_000_000  # a few milliseconds at GPU clocks
    _cycles_per_ms: dict[int, float] = {}

    def __init__(self, device: torch.device | int | None = None) -> None:
        if isinstance(device, int):
            index = device
        else:
            index = None if device is None else torch.device(device).index
        self.index = torch.cuda.current_device() if index is None else index
        self.cycles_per_ms = self._calibrate(self.index)

    @classmethod
    def _calibrate(cls, index: int) -> float:
        if index not in cls._cycles_per_ms:
            with torch.cuda.device(index):
                torch.cuda._sleep(1000)  # load the kernel
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cls.CALIBRATION_CYCLES)
                end.record()
                end.synchronize()
                ms = max(start.elapsed_time(end), 1e-3)
            cls._cycles_per_ms[index] = cls.CALIBRATION_CYCLES / ms
        return cls._cycles_per_ms[index]

    def sleep(self, ms: float) -> Callable[[], bool]:
        torch.cuda._sleep(max(1, int(ms * self.cycles_per_ms)))
        done = torch.cuda.Event()
        done.record()
        return done.query

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def _max_code(code: int, group) -> int:
    """The largest of the ranks' ``code``."""
    return int(_allreduce_max([float(code)], group)[0][0])


def host_time_per_call(
    fn: Callable[[], object],
    *,
    calls: int,
    wall_ms_per_call: float,
    rounds: int = 3,
    group: dist.ProcessGroup | None = None,
    gpu: GpuQueue | None = None,
    clock: Callable[[], float] = time.perf_counter,
    max_sleep_ms: float = MAX_HOST_SLEEP_MS,
) -> HostTime:
    """Host milliseconds per call of ``fn``, issued while the GPU is kept busy.

    Each round: device synchronisation, a GPU sleep queued (``gpu.sleep``), ``calls``
    back-to-back calls timed with ``clock``, a device synchronisation; the round's host time
    is the elapsed time over ``calls``. The first sleep is twice the calls' wall time
    (``wall_ms_per_call``, an upper bound of the host time, from the eager windows) plus
    10 ms, within [:data:`MIN_HOST_SLEEP_MS`, ``max_sleep_ms``] (fewer calls where it would
    not fit); later rounds use three times the host time measured plus 10 ms.

    A round counts only if the sleep was still running when the last call returned (so the
    host never waited for the GPU). If it was not: when the sleep ended during the first
    call, that call waited for the GPU, and one more try with a single call and a sleep four
    times as long decides; otherwise (a sleep too short, a full launch queue) the round is
    tried again with a sleep four times as long and a quarter of the calls, at most
    :data:`HOST_ATTEMPTS` tries in all. A round that never counts makes the result
    ``synced`` (the function synchronises with the GPU; ``ms`` NaN). Returns the median
    over ``rounds`` rounds, the slowest rank's with a ``group`` (every rank calls it; the
    ranks retry together).

    ``gpu`` and ``clock`` are for tests (default: :class:`CudaSleep` and ``perf_counter``).
    """
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls ({calls}) and rounds ({rounds}) must be >= 1")
    if gpu is None:
        gpu = CudaSleep()
    wall = max(float(wall_ms_per_call), 0.0) if math.isfinite(wall_ms_per_call) else 0.0
    room = max_sleep_ms - 10.0
    if wall > 0 and 2 * calls * wall > room:
        calls = max(1, int(room / (2 * wall)))
    sleep_ms = min(max(2 * calls * wall + 10.0, MIN_HOST_SLEEP_MS), max_sleep_ms)
    samples: list[float] = []
    for _ in range(rounds):
        measured = None
        attempts = 0
        n = calls  # this attempt's calls (one while confirming a wait in the first call)
        while measured is None:
            attempts += 1
            _barrier(group)
            gpu.synchronize()
            finished = gpu.sleep(sleep_ms)
            t0 = clock()
            fn()
            t1 = clock()
            waited_first = finished()  # outside the timed calls
            t2 = clock()
            for _ in range(n - 1):
                fn()
            t3 = clock()
            # 0: the host got ahead of the GPU; 1: the sleep ended during later calls;
            # 2: it ended during the first call (that call waited for the GPU)
            code = 2 if waited_first else (1 if finished() else 0)
            gpu.synchronize()
            code = _max_code(code, group)
            if code == 0:
                measured = ((t1 - t0) + (t3 - t2)) * 1e3 / n
            elif attempts >= HOST_ATTEMPTS or (code == 2 and n == 1 and attempts > 1):
                return HostTime(ms=math.nan, synced=True, calls=n, rounds=0, sleep_ms=sleep_ms)
            elif code == 2:  # one more try, one call behind a longer sleep, decides
                n, sleep_ms = 1, min(4 * sleep_ms, max_sleep_ms)
            else:  # a sleep too short or a full launch queue: longer, and fewer calls
                calls = max(1, calls // 4)
                n, sleep_ms = calls, min(4 * sleep_ms, max_sleep_ms)
        samples.append(measured)
        sleep_ms = min(max(3 * calls * measured + 10.0, MIN_HOST_SLEEP_MS), max_sleep_ms)
    ms = _allreduce_max([float(statistics.median(samples))], group)[0][0]
    return HostTime(ms=ms, calls=calls, rounds=len(samples), sleep_ms=sleep_ms)


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
