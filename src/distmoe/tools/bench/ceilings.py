"""Hardware ceilings measured in the same run as the benchmarks (shared/DESIGN.md, Baselines).

- dense bf16 matmul TFLOP/s: ``torch.mm`` into a preallocated output, best of a few shapes;
- the same at 4096^3 in windows as long as a large layer case's (``dense_bf16_sustained``):
  the rate at the clock a GPU keeps under sustained load;
- fp8 rowwise matmul TFLOP/s: ``torch._scaled_mm`` on e4m3 operands with per-row (A) and
  per-column (B) fp32 scales and a bf16 output, with and without fast accumulation, best of;
- device copy GB/s: ``dst.copy_(src)`` of a 2 GiB buffer, counting bytes read plus bytes
  written (2 x size per copy);
- device read GB/s: ``torch.sum`` of a 2 GiB fp32 buffer, counting the bytes read (the bound
  for work that streams weights and writes little, such as decode);
- peer copy GB/s between GPU 0 and GPU 1 when two are visible: one direction each, counting the
  bytes moved once (write: GPU 0 -> GPU 1 issued on GPU 0; read: GPU 1 -> GPU 0 issued on GPU 0).

All use :func:`distmoe.tools.bench.timing.benchmark` (CUDA-graph windows, except the peer
copies, timed eagerly) so ceilings and cases are timed alike. GFLOP/s figures are decimal
(1e9). Everything returns ``None``-valued fields rather than raising when a ceiling cannot
be measured (no CUDA, no fp8 support, one GPU); the reason is kept in :attr:`Ceiling.note`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from distmoe.tools.bench.report import error_text
from distmoe.tools.bench.timing import TimingConfig, benchmark

DENSE_SHAPES: tuple[tuple[int, int, int], ...] = (
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 8192, 8192),
)
FP8_SHAPES: tuple[tuple[int, int, int], ...] = ((8192, 8192, 8192), (16384, 8192, 8192))
COPY_BYTES = 2 << 30
PEER_BYTES = 1 << 30
# Window of the sustained dense ceiling: about one window (30 iterations) of the dense-e32
# forward on an H200.
SUSTAINED_WINDOW_MS = 160.0


@dataclass(kw_only=True)
class Ceiling:
    """One measured ceiling.

    Attributes:
        name: ``dense_bf16``, ``dense_bf16_sustained``, ``fp8_rowwise``, ``device_copy``,
            ``device_read``, ``peer_write``, ``peer_read``.
        value: best measured rate (TFLOP/s for matmuls, GB/s for copies), ``None`` if unmeasured.
        unit: ``"TFLOP/s"`` or ``"GB/s"``.
        detail: the configuration of the best measurement (shape, bytes, accumulation mode).
        iter_ms, window_min_ms, window_max_ms, method: timing of the best measurement.
        sm_clock_mhz, power_w: the GPU's SM clock and board power over the best
            measurement's timed windows (:mod:`~distmoe.tools.bench.telemetry`; ``None``
            without ``nvidia-smi``): the sustained matmul's clock is the one to compare a
            layer case's with.
        note: why it is missing, or extra context.
        all_values: every configuration tried with its rate.
    """

    name: str
    unit: str
    value: float | None = None
    detail: str = ""
    iter_ms: float | None = None
    window_min_ms: float | None = None
    window_max_ms: float | None = None
    method: str = ""
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    note: str = ""
    all_values: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Ceilings:
    """All ceilings of one run; ``by_name`` maps a name to its :class:`Ceiling`."""

    items: list[Ceiling]

    def by_name(self, name: str) -> Ceiling | None:
        return next((c for c in self.items if c.name == name), None)

    def value(self, name: str) -> float | None:
        c = self.by_name(name)
        return None if c is None else c.value

    def as_dicts(self) -> list[dict]:
        return [asdict(c) for c in self.items]


def _record(ceiling: Ceiling, key: str, rate: float, result) -> None:
    ceiling.all_values[key] = rate
    if ceiling.value is None or rate > ceiling.value:
        ceiling.value, ceiling.detail = rate, key
        ceiling.iter_ms = result.stats.iter_ms
        ceiling.window_min_ms, ceiling.window_max_ms = result.stats.min_ms, result.stats.max_ms
        ceiling.method = result.method
        telemetry = getattr(result, "telemetry", None)
        if telemetry is not None:
            ceiling.sm_clock_mhz, ceiling.power_w = telemetry.sm_clock_mhz, telemetry.power_w


def dense_bf16(device: torch.device, config: TimingConfig, shapes=DENSE_SHAPES) -> Ceiling:
    """Best ``torch.mm`` bf16 TFLOP/s over ``shapes`` (M, N, K)."""
    c = Ceiling(name="dense_bf16", unit="TFLOP/s")
    for m, n, k in shapes:
        try:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(
                n, k, device=device, dtype=torch.bfloat16
            ).t()  # column-major, as weights
            out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            res = benchmark(
                lambda a=a, b=b, out=out: torch.mm(a, b, out=out), config=config, device=device
            )
            _record(c, f"{m}x{n}x{k}", 2 * m * n * k / (res.iter_ms * 1e-3) / 1e12, res)
            del a, b, out
        except Exception as exc:
            c.note = error_text(exc)
    return c


def dense_bf16_sustained(
    device: torch.device, config: TimingConfig, *, window_ms: float = SUSTAINED_WINDOW_MS,
    shape: tuple[int, int, int] = (4096, 4096, 4096),
) -> Ceiling:
    """``torch.mm`` bf16 TFLOP/s in windows at least ``window_ms`` long (whole multiples of 30
    iterations, sized from a burst timing), back to back like the layer's windows.

    The layer cases run 30 iterations per window, 5 ms to 0.2 s; the ``dense_bf16`` ceiling
    runs 30 matmuls of about 0.17 ms (a 5 ms window). A Hopper GPU under seconds of full
    load lowers its SM clock (evidence: docs/performance.md), so this ceiling is the matmul
    rate at the clock the long layer cases run at."""
    m, n, k = shape
    c = Ceiling(name="dense_bf16_sustained", unit="TFLOP/s")
    try:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
        out = torch.empty(m, n, device=device, dtype=torch.bfloat16)

        def fn(a=a, b=b, out=out):
            return torch.mm(a, b, out=out)

        burst = benchmark(fn, config=config, device=device)
        iters = 30 * max(1, math.ceil(window_ms / (30 * burst.stats.iter_ms)))
        long = replace(config, iters_per_window=iters, capture_iters=iters,
                       num_warmup=min(config.num_warmup, 2))
        res = benchmark(fn, config=long, device=device)
        _record(c, f"{m}x{n}x{k} x{iters}/window", 2 * m * n * k / (res.iter_ms * 1e-3) / 1e12,
                res)
        del a, b, out
    except Exception as exc:
        c.note = error_text(exc)
    return c


def fp8_rowwise(device: torch.device, config: TimingConfig, shapes=FP8_SHAPES) -> Ceiling:
    """Best ``torch._scaled_mm`` e4m3 rowwise-scaled TFLOP/s (bf16 output)."""
    c = Ceiling(name="fp8_rowwise", unit="TFLOP/s")
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        c.note = "torch._scaled_mm or float8_e4m3fn missing"
        return c
    for m, n, k in shapes:
        try:
            a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # [K, N] column-major
            scale_a = torch.rand(m, 1, device=device, dtype=torch.float32) + 0.5
            scale_b = torch.rand(1, n, device=device, dtype=torch.float32) + 0.5
            for fast in (False, True):

                def fn(a=a, b=b, sa=scale_a, sb=scale_b, fast=fast):
                    return torch._scaled_mm(
                        a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast
                    )

                res = benchmark(fn, config=config, device=device)
                accum = "fast_accum" if fast else "fp32_accum"
                _record(c, f"{m}x{n}x{k} {accum}", 2 * m * n * k / (res.iter_ms * 1e-3) / 1e12, res)
            del a, b, scale_a, scale_b
        except Exception as exc:
            c.note = error_text(exc)
    return c


def device_copy(device: torch.device, config: TimingConfig, nbytes: int = COPY_BYTES) -> Ceiling:
    """``dst.copy_(src)`` GB/s on one device, counting read + write bytes."""
    c = Ceiling(name="device_copy", unit="GB/s")
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        res = benchmark(lambda dst=dst, src=src: dst.copy_(src), config=config, device=device)
        _record(
            c, f"{nbytes / 2**30:g} GiB read + write", 2 * nbytes / (res.iter_ms * 1e-3) / 1e9, res
        )
        del src, dst
    except Exception as exc:
        c.note = error_text(exc)
    return c


def device_read(device: torch.device, config: TimingConfig, nbytes: int = COPY_BYTES) -> Ceiling:
    """``torch.sum`` of an fp32 buffer of ``nbytes`` GB/s, counting the bytes read."""
    c = Ceiling(name="device_read", unit="GB/s")
    try:
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
        out = torch.empty((), dtype=torch.float32, device=device)
        res = benchmark(lambda src=src, out=out: torch.sum(src, 0, out=out), config=config,
                        device=device)
        _record(c, f"{nbytes / 2**30:g} GiB read", nbytes / (res.iter_ms * 1e-3) / 1e9, res)
        del src, out
    except Exception as exc:
        c.note = error_text(exc)
    return c


def peer_copies(config: TimingConfig, nbytes: int = PEER_BYTES) -> list[Ceiling]:
    """GPU 0 <-> GPU 1 copy GB/s, one direction each, bytes counted once; needs two GPUs."""
    write = Ceiling(name="peer_write", unit="GB/s")
    read = Ceiling(name="peer_read", unit="GB/s")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        write.note = read.note = "needs two visible GPUs"
        return [write, read]
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    # Timed eagerly: the cross-device copy's capture failed (the timing fell back to eager),
    # and every run with two GPUs visible then aborted at exit with torch 2.11's
    # "captures_underway.empty()" allocator assert; runs on one GPU did not. A 1 GiB copy needs no graph to hide launch overhead.
    config = replace(config, use_cuda_graph=False)
    try:
        with torch.cuda.device(d0):
            a0 = torch.empty(nbytes, dtype=torch.uint8, device=d0).fill_(1)
            a1 = torch.empty(nbytes, dtype=torch.uint8, device=d1).fill_(2)
            b0 = torch.empty_like(a0)
            res = benchmark(lambda a0=a0, a1=a1: a1.copy_(a0), config=config, device=d0)
            _record(
                write,
                f"{nbytes / 2**30:g} GiB cuda:0 -> cuda:1",
                nbytes / (res.iter_ms * 1e-3) / 1e9,
                res,
            )
            res = benchmark(lambda a1=a1, b0=b0: b0.copy_(a1), config=config, device=d0)
            _record(
                read,
                f"{nbytes / 2**30:g} GiB cuda:1 -> cuda:0",
                nbytes / (res.iter_ms * 1e-3) / 1e9,
                res,
            )
            del a0, a1, b0
        note = "" if torch.cuda.can_device_access_peer(0, 1) else "no peer access: staged copy"
        write.note = read.note = note
    except Exception as exc:
        write.note = read.note = error_text(exc)
    return [write, read]


def measure_all(device: torch.device, config: TimingConfig, *, peer: bool = True) -> Ceilings:
    """Every ceiling this machine allows (empty values and a note on CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        items = [
            Ceiling(name=n, unit=u, note="needs CUDA")
            for n, u in (
                ("dense_bf16", "TFLOP/s"),
                ("dense_bf16_sustained", "TFLOP/s"),
                ("fp8_rowwise", "TFLOP/s"),
                ("device_copy", "GB/s"),
                ("device_read", "GB/s"),
                ("peer_write", "GB/s"),
                ("peer_read", "GB/s"),
            )
        ]
        return Ceilings(items=items)
    items = [dense_bf16(device, config), dense_bf16_sustained(device, config),
             fp8_rowwise(device, config), device_copy(device, config), device_read(device, config)]
    if peer:
        items += peer_copies(config)
    torch.cuda.empty_cache()
    return Ceilings(items=items)
