"""The kernel-profile quantities of a layer step (``python -m distmoe profile --quantities``):
each profiled kernel put in one phase by its name, then per step the launch count, the time of
each phase (PUT: dispatch and scatter; GET: token pulls and gathers; combine reduce; grouped GEMMs and their achieved rate,
weight gradients, FP8 quantisation, scale layout, routing, barriers, collectives, PyTorch's
own kernels), the padding the grouped GEMMs run on, and the peak allocated memory of the
forward and the backward. Why: they separate what moving rows costs from what computing on
them costs, and show what a precision's extra passes take.

Phases, by kernel name (the first pattern that matches, case-insensitive; :data:`PHASES`):
the grouped GEMMs are every W13 / W2 forward and input-gradient kernel (Triton, Gluon, the
block-scaled and FP4-weight forms, Mega's fused kernel); the weight gradients are split into
FP8 (``scaled``) and bf16 ones (in an FP8 layer the latter are the "bf16 WGRAD in the MXFP8
path" the seed asks for). A kernel no pattern names is ``other``, listed by name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

#: (phase, regex on the kernel name), first match wins
PHASES: tuple[tuple[str, str], ...] = (
    ("barrier", r"device_barrier"),
    ("collective (NCCL)", r"nccl"),
    ("weight gradient, FP8", r"scaled_wgrad"),
    ("weight gradient, bf16", r"wgrad"),
    ("FP8 quantisation", r"quant|nvfp4_amax|mxfp8_weight"),
    ("scale layout", r"rebase|swizzle|scale_layout"),
    ("grouped GEMM", r"w13|w2_|w2\b|grouped_gemm|grouped_mm|gluon_scaled|fused_kernel|gemm"),
    ("PUT (dispatch, scatter)", r"put_rows|rowwise_put|publish_ids|push_route|scatter_rows"
                                r"|offset_copy"),
    ("GET (pull, gather)", r"pull_tokens|gather_rows|regather|rowwise_gather|combine_get"),
    ("combine reduce", r"combine|reduce_routes|route_grads"),
    ("routing", r"routing|block_prefix|block_ranks|blocked_|mark_tokens|phase_order"
                r"|local_routes|count_call|begin_layer|slot"),
    ("copies (memcpy / memset)", r"memcpy|memset|\bcopy"),
    ("PyTorch kernels", r"at::native|at::|cutlass|cublas|sm90_xmma|elementwise|reduce_kernel"),
)
_COMPILED = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in PHASES)
#: quantities of the seed's list that this layer has no counterpart of, and why
NOT_APPLICABLE = {
    "rowwise stream wait under TBO": "distmoe runs no two-batch overlap: one stream per call",
}


def phase_of(kernel: str) -> str:
    """The phase of a kernel name (:data:`PHASES`), ``"other"`` where none matches."""
    for name, pattern in _COMPILED:
        if pattern.search(kernel):
            return name
    return "other"


@dataclass
class Quantities:
    """One step's quantities (times in ms per step)."""

    launches: int
    total_ms: float
    phases: dict[str, dict] = field(default_factory=dict)  # phase -> {ms, launches, kernels}
    useful_tflop: float = 0.0  # useful TFLOP of one step (6 T K D F, x3 with the backward)
    gemm_tflops: float | None = None  # achieved over the grouped GEMMs and weight gradients
    live_rows: int | None = None
    padded_rows: int | None = None
    peak_gib: dict[str, float | None] = field(default_factory=dict)
    not_applicable: dict[str, str] = field(default_factory=lambda: dict(NOT_APPLICABLE))

    @property
    def padding_overhead(self) -> float | None:
        """Padded rows over live rows, minus one (the grouped GEMMs' wasted share)."""
        if not self.live_rows or self.padded_rows is None:
            return None
        return self.padded_rows / self.live_rows - 1.0


def padded_rows(counts: list[int], row_block: int) -> int:
    """Rows the grouped GEMMs run on: each expert's rows rounded up to ``row_block``."""
    return sum(-(-c // row_block) * row_block for c in counts)


def quantities(rows: list[tuple[float, int, str]], *, useful_tflop: float,
               counts: list[int] | None = None, row_block: int = 128,
               peak_gib: dict[str, float | None] | None = None) -> Quantities:
    """:class:`Quantities` from ``rows`` = ``(ms per step, launches per step, kernel name)``
    of the profiled kernels, the step's useful TFLOP, this rank's rows per local expert
    (``counts``) and the peaks by phase."""
    q = Quantities(launches=sum(r[1] for r in rows), total_ms=sum(r[0] for r in rows),
                   useful_tflop=useful_tflop, peak_gib=dict(peak_gib or {}))
    for ms, calls, name in rows:
        p = q.phases.setdefault(phase_of(name), {"ms": 0.0, "launches": 0, "kernels": []})
        p["ms"] += ms
        p["launches"] += calls
        p["kernels"].append(name)
    gemm_ms = sum(q.phases.get(p, {}).get("ms", 0.0) for p in
                  ("grouped GEMM", "weight gradient, FP8", "weight gradient, bf16"))
    if gemm_ms > 0:
        q.gemm_tflops = useful_tflop / (gemm_ms * 1e-3)
    if counts is not None:
        q.live_rows, q.padded_rows = sum(counts), padded_rows(counts, row_block)
    return q


def format_quantities(q: Quantities) -> list[str]:
    """The quantities as lines of text."""
    lines = [f"kernel launches per step: {q.launches}; kernel time {q.total_ms:.3f} ms",
             f"{'phase':<28} {'ms/step':>9} {'share':>6} {'launches':>8}"]
    for name, p in sorted(q.phases.items(), key=lambda kv: -kv[1]["ms"]):
        share = 100 * p["ms"] / q.total_ms if q.total_ms > 0 else 0.0
        lines.append(f"{name:<28} {p['ms']:9.3f} {share:5.1f}% {p['launches']:8d}")
    if "other" in q.phases:
        lines.append("  other: " + ", ".join(q.phases["other"]["kernels"][:8]))
    rate = "n/a" if q.gemm_tflops is None else f"{q.gemm_tflops:.0f} TFLOP/s"
    lines.append(f"grouped GEMMs and weight gradients: {q.useful_tflop:.3f} useful TFLOP per "
                 f"step at {rate}")
    if q.padding_overhead is not None:
        lines.append(f"padding: {q.padded_rows} padded rows for {q.live_rows} live "
                     f"({100 * q.padding_overhead:.1f}% more GEMM rows)")
    for phase, gib in q.peak_gib.items():
        lines.append(f"peak allocated, {phase}: "
                     + ("n/a" if gib is None or math.isnan(gib) else f"{gib:.2f} GiB"))
    for name, why in q.not_applicable.items():
        lines.append(f"{name}: not applicable ({why})")
    return lines


def as_json(q: Quantities) -> dict:
    """The quantities as a JSON-ready dict."""
    return dict(launches=q.launches, total_ms=q.total_ms, phases=q.phases,
                useful_tflop=q.useful_tflop, gemm_tflops=q.gemm_tflops,
                live_rows=q.live_rows, padded_rows=q.padded_rows,
                padding_overhead=q.padding_overhead, peak_gib=q.peak_gib,
                not_applicable=q.not_applicable)
