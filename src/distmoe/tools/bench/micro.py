"""Grouped-GEMM micro-benchmarks (``bench --micro``), on one GPU.

1. Grouped GEMM versus capacity-padded BMM: one BF16 projection [M_e, d] x [d, h] for each of
   16 local experts, balanced rows, d = h in {4096, 2048}, total rows M from 4K to 256K.
   ``torch._grouped_mm`` executes exactly the valid rows; ``torch.bmm`` executes a fixed
   capacity C = ceil(1.25 * M / 16) rows per expert (padding included). Useful FLOPs
   2*M*d*h for both. Reported: time, useful TFLOP/s, BMM/grouped time ratio and the crossover
   (the interval of M where grouped GEMM becomes and stays faster).
2. Matched grouped-versus-dense projection: one dense weight [81920, 8192] (out, in); its output
   rows split into 4 or 8 experts (views of the same values), the input X repeated once per
   expert; same useful FLOPs 2*T*8192*81920. Sampled output rows are compared bitwise with the
   dense result (reported, not asserted: cuBLAS and CUTLASS may order the K reduction
   differently).
3. Expert histogram at equal maximum load: 16 experts, d = h = 4096; balanced, a single spike
   (one expert holds ``hot_fraction`` of the rows, the rest evenly) and three-hot (three
   experts hold ``hot_fraction`` each, the other 13 share the rest), all counts multiples of
   8, so both skewed cases have the same total rows, the same maximum and the same useful
   FLOPs. Reported: TFLOP/s relative to balanced.

Weights are stored (out, in) like the layer's and passed transposed to both paths. Routing,
activation, backward and communication are outside every timed region.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from distmoe.tools.bench.timing import TimingConfig, TimingResult, benchmark

GROUPED_VS_BMM_ROWS = tuple(k * 1024 for k in (4, 8, 16, 32, 64, 128, 256))
MATCHED_TOKENS_DEFAULT = (16, 256, 1024, 4096, 8192)
MATCHED_TOKENS_FULL = tuple(2**i for i in range(17))
HISTOGRAM_ROWS = tuple(k * 1024 for k in (16, 32, 64, 128))
HOT_FRACTION = 0.3167  # the seed's matched single spike: 31.67% of all rows


@dataclass(kw_only=True)
class MicroRow:
    """One micro-benchmark measurement (CSV row of ``micro.csv``).

    Attributes:
        benchmark: ``grouped_vs_bmm``, ``matched_projection`` or ``histogram``.
        provider: ``grouped_mm``, ``bmm``, ``dense``, ``grouped_4``, ``grouped_8``.
        variant: histogram name (``balanced``, ``single_spike``, ``three_hot``) or "".
        experts, d, h: problem widths; rows: total valid rows (M or T).
        iter_ms, window_min_ms, window_max_ms, method: timing.
        tflops: useful TFLOP/s; relative: vs. the benchmark's reference (see ``note``).
        max_load_ratio: max rows of one expert / mean rows (``I_max``).
        note: free text (bitwise check, reference of ``relative``, failures).
    """

    benchmark: str
    provider: str
    variant: str = ""
    experts: int = 0
    d: int = 0
    h: int = 0
    rows: int = 0
    iter_ms: float = math.nan
    window_min_ms: float = math.nan
    window_max_ms: float = math.nan
    method: str = ""
    tflops: float = math.nan
    relative: float = math.nan
    max_load_ratio: float = math.nan
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


MICRO_COLUMNS: tuple[str, ...] = tuple(MicroRow.__dataclass_fields__)


# ----------------------------------------------------------------------------- pure helpers


def capacity_rows(total_rows: int, num_experts: int, factor: float = 1.25) -> int:
    """Per-expert capacity of the padded BMM: ``ceil(factor * total_rows / num_experts)``."""
    return math.ceil(factor * total_rows / num_experts)


def spike_counts(
    total_rows: int,
    num_experts: int,
    hot_experts: Sequence[int],
    *,
    hot_fraction: float = HOT_FRACTION,
    align: int = 8,
) -> list[int]:
    """Rows per expert: each hot expert gets ``hot_fraction`` of all rows (rounded down to
    ``align``), the others share the rest evenly in units of ``align``; sum == total_rows.

    ``total_rows`` must be a multiple of ``align``.
    """
    if total_rows % align:
        raise ValueError(f"total_rows ({total_rows}) must be a multiple of align ({align})")
    hot = sorted(set(hot_experts))
    if not hot or len(hot) >= num_experts or min(hot) < 0 or max(hot) >= num_experts:
        raise ValueError(
            f"hot_experts ({list(hot_experts)}) must name 1..{num_experts - 1} experts"
        )
    hot_rows = int(hot_fraction * total_rows) // align * align
    rest_units = (total_rows - hot_rows * len(hot)) // align
    if rest_units < 0:
        raise ValueError(f"hot_fraction ({hot_fraction}) x {len(hot)} hot experts exceeds all rows")
    cold = [e for e in range(num_experts) if e not in hot]
    base, extra = divmod(rest_units, len(cold))
    counts = [hot_rows if e in hot else 0 for e in range(num_experts)]
    for i, e in enumerate(cold):
        counts[e] = (base + (1 if i < extra else 0)) * align
    return counts


def max_load_ratio(counts: Sequence[int]) -> float:
    """``I_max``: the largest expert's rows over the mean rows per expert."""
    return max(counts) / (sum(counts) / len(counts))


def crossover(
    rows: Sequence[int], grouped_ms: Sequence[float], bmm_ms: Sequence[float]
) -> tuple[int, int] | None:
    """Interval ``(lo, hi)`` of consecutive swept row counts between which grouped GEMM becomes
    faster than BMM and stays faster for every larger count.

    ``(rows[0], rows[0])`` when grouped is faster everywhere; ``None`` when it is not faster at
    the largest count. ``rows`` must be increasing.
    """
    if not (len(rows) == len(grouped_ms) == len(bmm_ms)) or not rows:
        raise ValueError("rows, grouped_ms and bmm_ms must be non-empty and of equal length")
    faster = [g < b for g, b in zip(grouped_ms, bmm_ms, strict=True)]
    if not faster[-1]:
        return None
    i = len(faster) - 1
    while i > 0 and faster[i - 1]:
        i -= 1
    return (rows[0], rows[0]) if i == 0 else (rows[i - 1], rows[i])


# ----------------------------------------------------------------------------- measurements


def _fill(row: MicroRow, res: TimingResult, flops: float) -> MicroRow:
    row.iter_ms, row.method = res.stats.iter_ms, res.method
    row.window_min_ms, row.window_max_ms = res.stats.min_ms, res.stats.max_ms
    row.tflops = flops / (res.stats.iter_ms * 1e-3) / 1e12
    return row


def _offsets(counts: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(counts, device=device, dtype=torch.int32).cumsum(0).to(torch.int32)


def _grouped_case(counts, d, h, device, config, *, bench, variant="") -> MicroRow:
    e, m = len(counts), sum(counts)
    x = torch.randn(m, d, device=device, dtype=torch.bfloat16)
    w = torch.randn(e, h, d, device=device, dtype=torch.bfloat16) * d**-0.5
    offs = _offsets(counts, device)
    res = benchmark(
        lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), config=config, device=device
    )
    row = MicroRow(
        benchmark=bench,
        provider="grouped_mm",
        variant=variant,
        experts=e,
        d=d,
        h=h,
        rows=m,
        max_load_ratio=max_load_ratio(counts),
    )
    return _fill(row, res, 2.0 * m * d * h)


def grouped_vs_bmm(
    device: torch.device,
    config: TimingConfig,
    *,
    widths: Sequence[int] = (4096, 2048),
    total_rows: Sequence[int] = GROUPED_VS_BMM_ROWS,
    num_experts: int = 16,
) -> tuple[list[MicroRow], dict[int, tuple[int, int] | None]]:
    """Benchmark 1; returns the rows and, per width d, the crossover interval of M."""
    rows: list[MicroRow] = []
    crossings: dict[int, tuple[int, int] | None] = {}
    for d in widths:
        g_ms, b_ms, ms = [], [], []
        for m in total_rows:
            per_expert, cap = m // num_experts, capacity_rows(m, num_experts)
            # Same seeded activations and weights for both paths.
            x = torch.randn(m, d, device=device, dtype=torch.bfloat16)
            w = torch.randn(num_experts, d, d, device=device, dtype=torch.bfloat16) * d**-0.5
            offs = _offsets([per_expert] * num_experts, device)
            res = benchmark(
                lambda x=x, w=w, offs=offs: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
                config=config,
                device=device,
            )
            g = _fill(
                MicroRow(
                    benchmark="grouped_vs_bmm",
                    provider="grouped_mm",
                    experts=num_experts,
                    d=d,
                    h=d,
                    rows=m,
                    max_load_ratio=1.0,
                    relative=1.0,
                    note="relative = time / grouped time",
                ),
                res,
                2.0 * m * d * d,
            )
            xp = torch.zeros(num_experts, cap, d, device=device, dtype=torch.bfloat16)
            xp[:, :per_expert] = x.view(num_experts, per_expert, d)
            out = torch.empty(num_experts, cap, d, device=device, dtype=torch.bfloat16)
            res = benchmark(
                lambda xp=xp, w=w, out=out: torch.bmm(xp, w.transpose(1, 2), out=out),
                config=config,
                device=device,
            )
            b = _fill(
                MicroRow(
                    benchmark="grouped_vs_bmm",
                    provider="bmm",
                    experts=num_experts,
                    d=d,
                    h=d,
                    rows=m,
                    max_load_ratio=1.0,
                    note=f"capacity {cap} rows per expert; relative = time / grouped time",
                ),
                res,
                2.0 * m * d * d,
            )
            b.relative = b.iter_ms / g.iter_ms
            rows += [g, b]
            g_ms.append(g.iter_ms)
            b_ms.append(b.iter_ms)
            ms.append(m)
            del x, w, xp, out
            torch.cuda.empty_cache()
        crossings[d] = crossover(ms, g_ms, b_ms)
    return rows, crossings


def matched_projection(
    device: torch.device,
    config: TimingConfig,
    *,
    tokens: Sequence[int] = MATCHED_TOKENS_DEFAULT,
    d_in: int = 8192,
    d_out: int = 81920,
    splits: Sequence[int] = (4, 8),
    num_sampled_rows: int = 8,
) -> list[MicroRow]:
    """Benchmark 2: dense X @ W^T versus the same W split into experts (grouped)."""
    w = torch.randn(d_out, d_in, device=device, dtype=torch.bfloat16) * d_in**-0.5
    rows: list[MicroRow] = []
    for t in tokens:
        x = torch.randn(t, d_in, device=device, dtype=torch.bfloat16)
        flops = 2.0 * t * d_in * d_out
        res = benchmark(lambda x=x: x @ w.t(), config=config, device=device)
        dense = _fill(
            MicroRow(
                benchmark="matched_projection",
                provider="dense",
                experts=1,
                d=d_in,
                h=d_out,
                rows=t,
                relative=1.0,
                note="relative = TFLOP/s / dense TFLOP/s",
            ),
            res,
            flops,
        )
        rows.append(dense)
        y_dense = x @ w.t()
        sample = torch.randperm(t, generator=torch.Generator().manual_seed(t))[
            :num_sampled_rows
        ].to(device)
        for g in splits:
            w_g = w.view(g, d_out // g, d_in)  # exact dense values, no copy
            x_rep = x.repeat(g, 1)
            offs = torch.arange(1, g + 1, device=device, dtype=torch.int32) * t
            res = benchmark(
                lambda x_rep=x_rep, w_g=w_g, offs=offs: torch._grouped_mm(
                    x_rep, w_g.transpose(1, 2), offs=offs
                ),
                config=config,
                device=device,
            )
            row = _fill(
                MicroRow(
                    benchmark="matched_projection",
                    provider=f"grouped_{g}",
                    experts=g,
                    d=d_in,
                    h=d_out,
                    rows=t,
                ),
                res,
                flops,
            )
            row.relative = row.tflops / dense.tflops
            y_g = torch._grouped_mm(x_rep, w_g.transpose(1, 2), offs=offs).view(g, t, d_out // g)
            y_from_dense = y_dense.view(t, g, d_out // g).transpose(0, 1)
            equal = torch.equal(y_g[:, sample], y_from_dense[:, sample])
            diff = (y_g[:, sample].float() - y_from_dense[:, sample].float()).abs().max().item()
            row.note = f"sampled rows bitwise equal: {equal} (max abs diff {diff:.3g})"
            rows.append(row)
            del x_rep, y_g
        del x, y_dense
        torch.cuda.empty_cache()
    return rows


def histogram_effect(
    device: torch.device,
    config: TimingConfig,
    *,
    total_rows: Sequence[int] = HISTOGRAM_ROWS,
    bases: Sequence[int] = (0,),
    d: int = 4096,
    num_experts: int = 16,
) -> list[MicroRow]:
    """Benchmark 3: balanced vs single spike (expert a) vs three-hot (a, a+5, a+10 mod 16)."""
    rows: list[MicroRow] = []
    for m in total_rows:
        balanced = _grouped_case(
            [m // num_experts] * num_experts,
            d,
            d,
            device,
            config,
            bench="histogram",
            variant="balanced",
        )
        balanced.relative = 1.0
        rows.append(balanced)
        for a in bases:
            for variant, hot in (
                ("single_spike", [a]),
                ("three_hot", [a % num_experts, (a + 5) % num_experts, (a + 10) % num_experts]),
            ):
                counts = spike_counts(m, num_experts, hot)
                row = _grouped_case(
                    counts, d, d, device, config, bench="histogram", variant=variant
                )
                row.relative = row.tflops / balanced.tflops
                row.note = f"hot experts {hot}; relative = TFLOP/s / balanced"
                rows.append(row)
        torch.cuda.empty_cache()
    return rows
