"""Benchmark outputs: environment record, CSV and JSON writers, PNG plots and a text table.

Files of one run (in the output directory):

    cases.csv            one row per (provider, shape, tokens, imbalance, mode) and timing
                         (CUDA-graph replay, eager calls; one on the CPU): CASE_COLUMNS
    ceilings.csv         measured ceilings (dense bf16, fp8 rowwise, device copy, peer copy)
    micro.csv            micro-benchmark rows (--micro): MICRO_COLUMNS of micro.py
    roofline_model.csv   modeled GEMM-pair rate versus tokens (--roofline)
    results.json         everything above plus the environment, arguments and window times
    tflops.png           useful TFLOP/s per provider per shape, dense ceiling as a line
    roofline.png         cases on the measured roofline (useful FLOPs / modeled HBM bytes)
    roofline_model.png   modeled dense and MoE GEMM-pair rates versus T (--roofline)
    micro_*.png          micro-benchmark plots (--micro)

Plots use matplotlib's Agg backend (no display). Missing values are empty CSV cells and JSON
``null``.

:func:`markdown_tables` turns ``results.json`` files back into one markdown table per device
(docs/performance.md's current figures): ``python -m distmoe bench --tables FILE...`` (or
``python -m distmoe.tools.bench.report --markdown FILE...``).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import workloads

# Column name -> type, in CSV order.
CASE_COLUMNS: dict[str, type] = {
    "provider": str,
    "status": str,
    "shape": str,
    "tokens": int,
    "hidden": int,
    "ffn": int,
    "num_experts": int,
    "top_k": int,
    "ep_size": int,
    "imbalance": float,
    "routing": str,
    "achieved_imbalance": float,
    "tracked_rows": int,
    "active_experts": int,
    "precision": str,
    "transport": str,
    "mode": str,
    "timing_method": str,
    "iter_ms": float,
    "window_min_ms": float,
    "window_max_ms": float,
    "host_ms": float,
    "tflops": float,
    "pct_dense": float,
    "pct_dense_sustained": float,
    "hbm_gbps": float,
    "nvlink_gbps": float,
    "nvlink_measured_gbps": float,
    "sm_clock_mhz": float,
    "power_w": float,
    "peak_mem_gib": float,
    "max_rel_err_vs_torch": float,
    "baseline_path": str,
    "case_seconds": float,
    "note": str,
    # --suite seed (seed_suite.py); empty in the default suite's rows
    "suite_case": str,
    "layers": int,
    "shared_ffn": int,
    "kept": str,
    "plans_agree": str,
    "slot_gib": float,
    "scratch_gib": float,
    "peak_fwd_gib": float,
    "peak_bwd_gib": float,
}


#: Note of an eager row whose case has no graph figure although one was asked for:
#: ``graph: n/a (reason)``.
GRAPH_NA_NOTE = "graph: n/a"
#: Note of an eager row whose calls made the host wait for the GPU (``host_ms`` empty):
#: ``host: sync (...)``.
HOST_SYNC_NOTE = "host: sync"


@dataclass(kw_only=True)
class CaseResult:
    """One figure of one benchmark case; fields are :data:`CASE_COLUMNS` plus the window times
    (JSON only).

    A case timed both ways has two rows, alike but for the figure: ``timing_method``
    ``cuda_graph`` (CUDA-graph replay) and ``cuda_eager`` (eager calls between CUDA events);
    on the CPU one row, ``cpu``. ``host_ms`` (eager and CPU rows) is the host's time per
    call, issued while the GPU is kept busy (:func:`~distmoe.tools.bench.timing.host_time_per_call`;
    on the CPU the call's wall time); empty for graph rows and, with the note
    ``host: sync (...)``, for calls that make the host wait for the GPU.

    ``tflops`` is useful TFLOP/s (models.useful_flops / iter time), ``pct_dense`` its
    percentage of the dense bf16 matmul measured in the same run (5 ms windows: the burst
    clock), ``pct_dense_sustained`` of the same matmul in windows as long as a large case's
    (the clock under sustained load, ``ceilings.dense_bf16_sustained``), ``hbm_gbps`` and
    ``nvlink_gbps`` modeled bytes (models.py) / iter time, ``sm_clock_mhz`` and ``power_w``
    the medians of the GPU's SM clock and board power over the timed windows (rank 0's GPU;
    empty without ``nvidia-smi``: :mod:`~distmoe.tools.bench.telemetry`; an H200 at its
    power limit trades clock for utilisation), ``peak_mem_gib`` the peak of
    ``torch.cuda.max_memory_allocated`` during the case (inputs and weights included), plus
    the provider's symmetric-heap buffers that torch's allocator does not see (distmoe under
    symmetric memory; before commit 71e1582 these were left out).

    ``--suite seed`` rows (:mod:`~distmoe.tools.bench.seed_suite`) also fill: ``suite_case``
    (imbalance, width, packing, packing-shared), ``layers`` (layers in one timed step),
    ``shared_ffn`` (width of a shared expert), ``kept`` (per layer R saved, I replayed),
    ``plans_agree`` (a per-layer packing row: its outputs and gradients have the shared
    plan's bits, yes / no), ``slot_gib`` and ``scratch_gib`` (planned saved-state and scratch
    bytes), ``peak_fwd_gib`` / ``peak_bwd_gib`` (peak allocated bytes in the forward and the
    backward phase of an untimed step; empty on the CPU).
    """

    provider: str
    status: str
    shape: str
    tokens: int
    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    ep_size: int
    imbalance: float
    precision: str
    mode: str
    transport: str = ""  # distmoe's MoEContext transport ("" for the other providers)
    routing: str = "exact"
    achieved_imbalance: float | None = None
    tracked_rows: int | None = None
    #: local experts with at least one routed row (EP = 1: from the routing; else None, and
    #: the HBM model counts every local expert's weights)
    active_experts: int | None = None
    timing_method: str = ""
    iter_ms: float | None = None
    window_min_ms: float | None = None
    window_max_ms: float | None = None
    host_ms: float | None = None
    tflops: float | None = None
    pct_dense: float | None = None
    pct_dense_sustained: float | None = None
    hbm_gbps: float | None = None
    nvlink_gbps: float | None = None
    #: NVLink bytes measured by NVML GPM per GPU and direction, per second (bench.nvlink)
    nvlink_measured_gbps: float | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    peak_mem_gib: float | None = None
    max_rel_err_vs_torch: float | None = None
    baseline_path: str = ""
    case_seconds: float | None = None
    note: str = ""
    suite_case: str = ""
    layers: int | None = None
    shared_ffn: int | None = None
    kept: str = ""
    plans_agree: str = ""
    slot_gib: float | None = None
    scratch_gib: float | None = None
    peak_fwd_gib: float | None = None
    peak_bwd_gib: float | None = None
    window_ms: list[float] = field(default_factory=list)

    def as_row(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in CASE_COLUMNS}

    def as_dict(self) -> dict:
        return asdict(self)


assert set(CASE_COLUMNS) <= set(CaseResult.__dataclass_fields__), "CASE_COLUMNS out of sync"

_KEY_FIELDS = ("provider", "shape", "tokens", "hidden", "ffn", "num_experts", "top_k", "ep_size",
               "precision", "mode", "routing", "imbalance", "transport")
_KEY_DEFAULTS = {"precision": "bf16", "routing": "exact", "imbalance": 1.0}


def case_key(case: CaseResult | Mapping) -> tuple:
    """What makes a case (provider, shape, widths, EP, precision, mode, routing, imbalance,
    transport): the rows of its timings share it. distmoe rows of files written before the
    transport column (no value) are the peer transport's."""
    get = case.get if isinstance(case, Mapping) else lambda k, d=None: getattr(case, k, d)
    key = [get(k, _KEY_DEFAULTS.get(k)) for k in _KEY_FIELDS]
    if get("provider") == "distmoe" and not key[-1]:
        key[-1] = "peer"
    return tuple(key)


def timing_slot(case: CaseResult | Mapping) -> str:
    """Where a row's figure goes in the tables: ``"graph"`` (CUDA-graph replay, and a row
    without a figure) or ``"eager"`` (eager calls and the CPU's timing)."""
    get = case.get if isinstance(case, Mapping) else lambda k, d=None: getattr(case, k, d)
    return "eager" if get("timing_method") in ("cuda_eager", "cpu") else "graph"


def host_text(case: CaseResult | Mapping | None) -> str:
    """The host time per call of a row for the tables: ms, ``sync`` or ``-``."""
    if case is None:
        return "-"
    get = case.get if isinstance(case, Mapping) else lambda k, d=None: getattr(case, k, d)
    if HOST_SYNC_NOTE in (get("note") or ""):
        return "sync"
    return _fmt(get("host_ms"), ".3f")


def error_text(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, at most 300 characters (for notes)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# ----------------------------------------------------------------------------- environment


def _git_sha(repo: Path) -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked files), or
    ``$DISTMOE_GIT_SHA`` when set: a copy of a working tree run elsewhere (a remote GPU
    machine) may carry a stale ``.git``, so the caller names the commit it sent."""
    given = os.environ.get("DISTMOE_GIT_SHA", "").strip()
    if given:
        return given
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _distmoe_version() -> str:
    try:
        from importlib.metadata import version

        return version("distmoe")
    except Exception:
        pass
    try:
        import distmoe

        return str(getattr(distmoe, "__version__", "source tree"))
    except Exception:
        return "unknown"


def environment(argv: Sequence[str] | None = None) -> dict:
    """GPU, versions, git SHA, UTC date and command line of this run."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "unavailable"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 2),
                    "capability": f"{p.major}.{p.minor}",
                    "sm_count": p.multi_processor_count,
                }
            )
    if argv is None:  # the interpreter's own command line keeps "-m distmoe bench"
        argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))[1:]
    return {
        "gpu": gpus[0]["name"] if gpus else "none (CPU)",
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "triton": triton_version,
        "distmoe": _distmoe_version(),
        "python": platform.python_version(),
        "host": platform.node(),
        "git_sha": _git_sha(Path(__file__).resolve().parent),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *argv]),
    }


# ----------------------------------------------------------------------------- CSV / JSON


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: str | os.PathLike, rows: Iterable[Mapping], columns: Sequence[str]) -> Path:
    """CSV with a header of ``columns``; missing/None/NaN values are empty cells."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for row in rows:
            w.writerow([_cell(row.get(c)) for c in columns])
    return path


def read_cases_csv(path: str | os.PathLike) -> list[dict]:
    """Read ``cases.csv`` back with :data:`CASE_COLUMNS` types (empty cells become None, and so
    do the columns of an older file that lacks them; ``""`` for text)."""
    out = []
    with Path(path).open(newline="") as f:
        for raw in csv.DictReader(f):
            out.append(
                {
                    k: (None if raw.get(k, "") == "" and t is not str else t(raw.get(k, "")))
                    for k, t in CASE_COLUMNS.items()
                }
            )
    return out


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | os.PathLike, payload: Mapping) -> Path:
    """Strict JSON (NaN and inf written as null)."""
    path = Path(path)
    path.write_text(json.dumps(_json_safe(payload), indent=1, allow_nan=False) + "\n")
    return path


# ----------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_PROVIDER_COLORS = {"distmoe": "#1b9e77", "torch": "#7570b3", "torch_compile": "#d95f02",
                    "transformers": "#66a61e", "rowwise": "#e6ab02", "torch_fp8": "#a6761d",
                    "distmoe_per_layer": "#e7298a"}


def _ok(cases: Sequence[CaseResult]) -> list[CaseResult]:
    """The plotted rows: one per case, its graph figure where it has one, else its eager one."""
    ok = [
        c for c in cases if c.status == "ok" and c.tflops is not None and math.isfinite(c.tflops)
    ]
    chosen: dict[tuple, CaseResult] = {}
    for c in ok:
        key = case_key(c)
        if key not in chosen or (timing_slot(chosen[key]) == "eager"
                                 and timing_slot(c) == "graph"):
            chosen[key] = c
    picked = {id(c) for c in chosen.values()}
    return [c for c in ok if id(c) in picked]


def plot_tflops(
    cases: Sequence[CaseResult], dense_tflops: float | None, path: str | os.PathLike
) -> Path | None:
    """Bars of useful TFLOP/s per provider per (shape, imbalance), one panel per mode.

    Whiskers span the slowest and fastest window; the dashed line is the dense bf16 matmul
    measured in the same run; each bar is labelled with its % of that line.
    """
    ok = _ok(cases)
    if not ok:
        return None
    plt = _pyplot()
    modes = sorted({c.mode for c in ok}, key=lambda m: (m != "fwd", m))
    providers = [p for p in _PROVIDER_COLORS if any(c.provider == p for c in ok)]
    fig, axes = plt.subplots(
        len(modes),
        1,
        figsize=(
            max(8, 1.6 * len({(c.shape, c.tokens, c.imbalance) for c in ok})),
            4.2 * len(modes),
        ),
        squeeze=False,
    )
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        sel = [c for c in ok if c.mode == mode]
        # run order; precision apart (the seed suite times bf16 and mxfp8 of one shape)
        groups = list(dict.fromkeys((c.shape, c.tokens, c.imbalance, c.precision)
                                    for c in sel))
        width = 0.8 / max(1, len(providers))
        for j, prov in enumerate(providers):
            for i, g in enumerate(groups):
                match = [
                    c for c in sel
                    if c.provider == prov and (c.shape, c.tokens, c.imbalance, c.precision) == g
                ]
                if not match:
                    continue
                c = match[0]
                x = i - 0.4 + width * (j + 0.5)
                lo = c.tflops * c.iter_ms / c.window_max_ms if c.window_max_ms else c.tflops
                hi = c.tflops * c.iter_ms / c.window_min_ms if c.window_min_ms else c.tflops
                ax.bar(
                    x,
                    c.tflops,
                    width,
                    color=_PROVIDER_COLORS[prov],
                    label=prov if i == 0 else None,
                    # spread of the windows around the median; clamped at 0 (one window's
                    # bounds equal the median up to rounding, and matplotlib refuses < 0)
                    yerr=[[max(0.0, c.tflops - lo)], [max(0.0, hi - c.tflops)]],
                    capsize=2,
                )
                if c.pct_dense is not None and math.isfinite(c.pct_dense):
                    ax.text(x, hi, f"{c.pct_dense:.0f}%", ha="center", va="bottom", fontsize=7)
        if dense_tflops:
            ax.axhline(
                dense_tflops,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"dense bf16 matmul {dense_tflops:.0f}",
            )
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(
            [f"{s}\nT{t}" + (f" x{f:g}" if f != 1 else "") + (f" {p}" if p != "bf16" else "")
             for s, t, f, p in groups],
            fontsize=8,
        )
        ax.set_ylabel("useful TFLOP/s")
        ax.set_title(f"{mode}: useful TFLOP/s (median of windows; whiskers: window range)")
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_seed(cases: Sequence[CaseResult], path: str | os.PathLike) -> Path | None:
    """``--suite seed``: four panels. Iteration time against imbalance (one line per provider,
    precision and mode), useful TFLOP/s against expert width F, the packing workload's step
    time per plan against imbalance (with and without a shared expert, the layers each plan
    replayed written on its point), and peak allocated GiB by phase of every distmoe case.
    Points are the graph figure where there is one; whiskers the window range."""
    ok = [c for c in _ok(cases) if c.suite_case]
    if not ok:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    styles = {"fwd": "-", "fwdbwd": "--"}

    def line(ax, sel, x_of, y_of, label, color, ls, text=None):
        sel = sorted(sel, key=x_of)
        ys = [y_of(c) for c in sel]
        err = [[max(0.0, y - y_of(c) * c.window_min_ms / c.iter_ms) if c.window_min_ms else 0
                for c, y in zip(sel, ys, strict=True)],
               [max(0.0, y_of(c) * c.window_max_ms / c.iter_ms - y) if c.window_max_ms else 0
                for c, y in zip(sel, ys, strict=True)]]
        ax.errorbar([x_of(c) for c in sel], ys, yerr=err, color=color, linestyle=ls,
                    marker="o", capsize=2, label=label)
        for c, y in zip(sel, ys, strict=True):
            if text and text(c):
                ax.annotate(text(c), (x_of(c), y), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")

    def by(sel, *keys):
        out: dict[tuple, list] = {}
        for c in sel:
            out.setdefault(tuple(getattr(c, k) for k in keys), []).append(c)
        return out

    ax = axes[0, 0]
    for (prov, prec, mode), sel in by([c for c in ok if c.suite_case == "imbalance"],
                                      "provider", "precision", "mode").items():
        line(ax, sel, lambda c: c.imbalance, lambda c: c.iter_ms, f"{prov} {prec} {mode}",
             _PROVIDER_COLORS.get(prov), styles.get(mode), None)
    ax.set(xlabel="imbalance (tracked group's load / balanced)", ylabel="ms per iteration",
           title="one layer under routing imbalance")
    ax = axes[0, 1]
    for (prov, mode), sel in by([c for c in ok if c.suite_case == "width"],
                                "provider", "mode").items():
        line(ax, sel, lambda c: c.ffn, lambda c: c.tflops, f"{prov} {mode}",
             _PROVIDER_COLORS.get(prov), styles.get(mode), None)
    ax.set(xlabel="expert width F", ylabel="useful TFLOP/s",
           title="expert width at fixed T, D, E, K")
    ax = axes[1, 0]
    for (prov, kind), sel in by([c for c in ok if c.suite_case.startswith("packing")],
                                "provider", "suite_case").items():
        line(ax, sel, lambda c: c.imbalance, lambda c: c.iter_ms, f"{prov} {kind}",
             _PROVIDER_COLORS.get(prov), "--" if kind.endswith("shared") else "-",
             lambda c: c.kept)
    ax.set(xlabel="imbalance of the loaded layers", ylabel="ms per step (fwd+bwd, all layers)",
           title="packing: one shared slot (distmoe) vs per-layer budgets")
    ax = axes[1, 1]
    mem = [c for c in ok if c.provider.startswith("distmoe") and c.peak_fwd_gib is not None]
    if mem:
        labels = [f"{c.shape} {c.precision} {c.mode} x{c.imbalance:g}"
                  + ("" if c.provider == "distmoe" else " per-layer") for c in mem]
        xs = range(len(mem))
        ax.bar([x - 0.2 for x in xs], [c.peak_fwd_gib for c in mem], 0.4, label="forward")
        ax.bar([x + 0.2 for x in xs], [c.peak_bwd_gib or 0.0 for c in mem], 0.4,
               label="backward")
        ax.scatter(list(xs), [c.scratch_gib or 0.0 for c in mem], color="black", marker="_",
                   s=200, label="planned scratch", zorder=3)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=90, fontsize=5)
    else:
        ax.text(0.5, 0.5, "memory by phase: not measured (CPU)", ha="center",
                transform=ax.transAxes)
    ax.set(ylabel="peak allocated GiB", title="peak allocated memory by phase")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_roofline(
    cases: Sequence[CaseResult],
    *,
    peak_tflops: float,
    hbm_gbps: float,
    intensity: Mapping[int, float],
    path: str | os.PathLike,
    source: str,
) -> Path | None:
    """Cases on a log-log roofline: x = useful FLOPs / modeled HBM bytes, y = TFLOP/s.

    ``intensity`` maps ``id(case)`` to its modeled intensity; ``source`` says where the two
    ceilings came from (measured in this run or datasheet).
    """
    ok = [c for c in _ok(cases) if id(c) in intensity]
    if not ok:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [intensity[id(c)] for c in ok]
    knee = peak_tflops * 1e12 / (hbm_gbps * 1e9)  # balance point, FLOP/byte (eq. 91)
    lo, hi = min(xs + [knee]) / 4, max(xs + [knee]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(
        grid,
        [min(peak_tflops, x * hbm_gbps / 1e3) for x in grid],
        color="black",
        linewidth=1.2,
        label=f"roofline ({source}): {peak_tflops:.0f} TFLOP/s, {hbm_gbps:.0f} GB/s",
    )
    markers = {"fwd": "o", "fwdbwd": "s"}
    for prov, color in _PROVIDER_COLORS.items():
        for mode, marker in markers.items():
            sel = [c for c in ok if c.provider == prov and c.mode == mode]
            if sel:
                ax.scatter(
                    [intensity[id(c)] for c in sel],
                    [c.tflops for c in sel],
                    color=color,
                    marker=marker,
                    label=f"{prov} {mode}",
                    zorder=3,
                )
                for c in sel:
                    ax.annotate(
                        c.shape,
                        (intensity[id(c)], c.tflops),
                        fontsize=5,
                        alpha=0.7,
                        xytext=(3, 2),
                        textcoords="offset points",
                    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("useful FLOPs / modeled HBM bytes (FLOP/byte)")
    ax.set_ylabel("useful TFLOP/s")
    ax.set_title("Cases against the roofline (HBM bytes modeled, not measured)")
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_roofline_model(
    curves: Mapping[str, Sequence[Mapping]],
    *,
    source: str,
    path: str | os.PathLike,
    marks: Mapping[str, Sequence[int]] | None = None,
) -> Path | None:
    """Eq. 94: modeled rate / compute ceiling versus T, dense (dashed) and MoE (solid) per config.

    ``marks`` maps a config name to token counts (present in its curve) to highlight, e.g. the
    T a shape was benchmarked at.
    """
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, (name, pts) in enumerate(curves.items()):
        color = f"C{i % 10}"
        ts = [p["tokens"] for p in pts]
        ax.plot(ts, [p["moe_fraction"] for p in pts], color=color, label=f"{name} MoE")
        ax.plot(
            ts,
            [p["dense_fraction"] for p in pts],
            color=color,
            linestyle="--",
            alpha=0.7,
            label=f"{name} dense",
        )
        wanted = set((marks or {}).get(name, ()))
        hits = [p for p in pts if p["tokens"] in wanted]
        if hits:
            ax.scatter(
                [p["tokens"] for p in hits],
                [p["moe_fraction"] for p in hits],
                color=color,
                zorder=3,
                s=25,
            )
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("modeled rate / compute ceiling")
    ax.set_title(f"Forward GEMM pair roofline, equal FLOPs ({source}); dots: benchmarked T")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_micro(rows: Sequence[Mapping], out_dir: str | os.PathLike) -> list[Path]:
    """One PNG per micro-benchmark present in ``rows`` (dicts of MicroRow fields)."""
    plt = _pyplot()
    out_dir, written = Path(out_dir), []
    ok = [r for r in rows if r.get("tflops") is not None and math.isfinite(r["tflops"])]

    gv = [r for r in ok if r["benchmark"] == "grouped_vs_bmm"]
    if gv:
        widths = sorted({r["d"] for r in gv}, reverse=True)
        fig, axes = plt.subplots(1, len(widths), figsize=(6 * len(widths), 4.2), squeeze=False)
        for ax, d in zip(axes[0], widths, strict=True):
            for prov, style in (("grouped_mm", "o-"), ("bmm", "s--")):
                sel = sorted(
                    (r for r in gv if r["d"] == d and r["provider"] == prov),
                    key=lambda r: r["rows"],
                )
                ax.plot(
                    [r["rows"] for r in sel],
                    [r["tflops"] for r in sel],
                    style,
                    label="grouped GEMM (valid rows)"
                    if prov == "grouped_mm"
                    else "BMM (1.25x capacity)",
                )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("total routed rows M (16 experts)")
            ax.set_ylabel("useful TFLOP/s")
            ax.set_title(f"d = h = {d}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "micro_grouped_vs_bmm.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    mp = [r for r in ok if r["benchmark"] == "matched_projection"]
    if mp:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for prov in sorted({r["provider"] for r in mp}):
            sel = sorted((r for r in mp if r["provider"] == prov), key=lambda r: r["rows"])
            ax.plot([r["rows"] for r in sel], [r["tflops"] for r in sel], "o-", label=prov)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("useful TFLOP/s")
        ax.set_title("Matched projection: dense [T,8192]x[8192,81920] vs split into experts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "micro_matched_projection.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    hist = [r for r in ok if r["benchmark"] == "histogram"]
    if hist:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for variant, marker in (("balanced", "o"), ("single_spike", "^"), ("three_hot", "s")):
            sel = sorted((r for r in hist if r["variant"] == variant), key=lambda r: r["rows"])
            ax.plot(
                [r["rows"] for r in sel],
                [r["relative"] for r in sel],
                marker,
                linestyle="-",
                label=f"{variant} (I_max {sel[0]['max_load_ratio']:.2f})" if sel else variant,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("total routed rows M (16 experts, d = h = 4096)")
        ax.set_ylabel("TFLOP/s relative to balanced")
        ax.set_title("Same maximum load, different expert histograms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "micro_histogram.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


# ----------------------------------------------------------------------------- text table


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _imb_text(c: CaseResult) -> str:
    """The ``imb`` column: the imbalance factor, or ``smp`` for sampled routing."""
    return "smp" if c.routing == "sampled" else format(c.imbalance, "g")


# The case columns of :func:`format_table`: title and alignment ("<" left, ">" right).
_TABLE_COLUMNS = (
    ("provider", "<"),
    ("shape", "<"),
    ("T", ">"),
    ("mode", ">"),
    ("imb", ">"),
    ("graph ms", ">"),
    ("eager ms", ">"),
    ("host ms", ">"),
    ("range", ">"),
    ("TFLOP/s", ">"),
    ("%dense", ">"),
    ("%sust", ">"),
    ("HBM GB/s", ">"),
    ("MHz", ">"),
    ("W", ">"),
    ("peak GiB", ">"),
)
_TABLE_GAP = "  "  # between columns: numbers never touch, whatever their width


def _note_part(note: str, prefix: str) -> str:
    """The ``"; "``-separated part of ``note`` that starts with ``prefix`` ('' if none)."""
    return next((part for part in note.split("; ") if part.startswith(prefix)), "")


def merge_timings(cases: Sequence[CaseResult]) -> list[dict[str, CaseResult | None]]:
    """The rows of ``cases`` grouped by case (:func:`case_key`), in order of first appearance:
    ``{"graph": row, "eager": row, "other": row}`` (``other``: a row without a figure, a
    failed or unavailable case; a slot without a row is ``None``; the first row wins)."""
    groups: dict[tuple, dict[str, CaseResult | None]] = {}
    for c in cases:
        slots = groups.setdefault(case_key(c), {"graph": None, "eager": None, "other": None})
        slot = timing_slot(c) if c.timing_method else "other"
        if slots[slot] is None:
            slots[slot] = c
    return list(groups.values())


def format_table(cases: Sequence[CaseResult], ceilings: Sequence[Mapping] = ()) -> str:
    """A short table of the cases, then the ceilings, for the terminal.

    One line per case (distmoe over another transport than peer as ``distmoe/<transport>``):
    its graph figure (``n/a`` where the case could not be captured), its
    eager figure and its host time per call (``sync`` where the calls wait for the GPU) side
    by side; the window range and the rates are those of the graph figure where the case
    has one, else of the eager one. Each column is as wide as its title or its widest cell,
    columns are two spaces apart, and the status (with the note of a case that is not
    ``ok``, or why it has no graph figure) comes last."""
    rows = []
    statuses = []
    for slots in merge_timings(cases):
        graph, eager, other = slots["graph"], slots["eager"], slots["other"]
        c = graph or eager or other
        assert c is not None
        na = _note_part(eager.note, GRAPH_NA_NOTE) if eager is not None else ""
        graph_ms = _fmt(graph.iter_ms, ".3f") if graph is not None else ("n/a" if na else "-")
        rows.append(
            (
                c.provider + (f"/{c.transport}" if c.transport not in ("", "peer") else ""),
                c.shape,
                str(c.tokens),
                c.mode,
                _imb_text(c),
                graph_ms,
                _fmt(eager.iter_ms if eager is not None else None, ".3f"),
                host_text(eager),
                f"{_fmt(c.window_min_ms, '.3f')}-{_fmt(c.window_max_ms, '.3f')}",
                _fmt(c.tflops, ".1f"),
                _fmt(c.pct_dense, ".0f"),
                _fmt(c.pct_dense_sustained, ".0f"),
                _fmt(c.hbm_gbps, ".0f"),
                _fmt(c.sm_clock_mhz, ".0f"),
                _fmt(c.power_w, ".0f"),
                _fmt(c.peak_mem_gib, ".2f"),
            )
        )
        bad = next((r for r in (other, graph, eager) if r is not None and r.status != "ok"), None)
        if bad is not None:
            statuses.append(f"{bad.status}: {bad.note[:60]}")
        else:
            statuses.append("ok" + (f"; {na[:70]}" if na else ""))
    titles = tuple(t for t, _ in _TABLE_COLUMNS)
    widths = [max(len(cell) for cell in col) for col in zip(titles, *rows, strict=True)]

    def line(cells: Sequence[str], status: str) -> str:
        parts = [
            format(cell, f"{align}{w}")
            for cell, (_, align), w in zip(cells, _TABLE_COLUMNS, widths, strict=True)
        ]
        return _TABLE_GAP.join([*parts, status])

    header = line(titles, "status")
    lines = [header, "-" * len(header)]
    lines += [line(r, s) for r, s in zip(rows, statuses, strict=True)]
    if ceilings:
        lines.append("")
        for c in ceilings:
            value = _fmt(c.get("value"), ".1f")
            clock = ""
            if c.get("sm_clock_mhz") is not None and c.get("power_w") is not None:
                clock = f"({c['sm_clock_mhz']:.0f} MHz, {c['power_w']:.0f} W)"
            tail = " ".join(t for t in (c.get("detail", ""), clock, c.get("note", "")) if t)
            lines.append(f"ceiling {c['name']:<20} {value:>8} {c['unit']:<8} {tail}".rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------- markdown tables

#: Shape names of older results files and the names the bench uses now (the same layers);
#: defined in :mod:`.workloads`.
LEGACY_SHAPE_NAMES = workloads.LEGACY_SHAPE_NAMES
_MODE_TEXT = {"fwd": "forward", "bwd": "backward", "fwdbwd": "fwd+bwd"}
_MODE_ORDER = {"fwd": 0, "fwdbwd": 1, "bwd": 2}


def _routing_text(case: Mapping) -> str:
    if case.get("routing") == "sampled":
        return "sampled"
    imbalance = case.get("imbalance") or 1.0
    return "exact" if imbalance == 1 else f"exact, {imbalance:g}x hot group"


def _command_text(command: str) -> str:
    """The bench's command line with the interpreter's path shortened to ``python``."""
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    if words and Path(words[0]).name.startswith("python"):
        words[0] = "python"
    return " ".join(shlex.quote(w) for w in words)


def _timing_text(payload: Mapping, cases: Sequence[Mapping]) -> str:
    methods = {c.get("timing_method") for c in cases if c.get("timing_method")}
    timing = payload.get("timing") or {}
    if methods:
        graph, eager = "cuda_graph" in methods, bool(methods - {"cuda_graph"})
    else:
        graph = bool(timing.get("use_cuda_graph"))
        eager = not graph
    how = ("CUDA-graph replay and eager calls" if graph and eager
           else "CUDA-graph replay" if graph else "eager launches")
    if any(c.get("host_ms") is not None for c in cases):
        how += " (host time per eager call issued behind a GPU sleep)"
    if timing.get("num_windows") and timing.get("iters_per_window"):
        how += (
            f", median of {timing['num_windows']} windows of "
            f"{timing['iters_per_window']} iterations"
        )
    return how


def _graph_text(ms: float | None, graph: Mapping | None, eager: Mapping | None) -> str:
    """A graph time for the markdown tables: ms, ``n/a`` (the case could not be captured:
    its eager row says so) or ``-``."""
    if graph is None and eager is not None and GRAPH_NA_NOTE in (eager.get("note") or ""):
        return "n/a"
    return _fmt(ms, ".3f")


def _case_key(case: Mapping) -> tuple:
    shape = LEGACY_SHAPE_NAMES.get(case["shape"], case["shape"])
    return (
        shape,
        case["tokens"],
        case["hidden"],
        case["ffn"],
        case["num_experts"],
        case["top_k"],
        case["ep_size"],
        case.get("precision", "bf16"),
        case["mode"],
        case.get("routing", "exact"),
        case.get("imbalance") or 1.0,
    )


def _load_results(path: Path) -> dict:
    try:
        payload = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"results file {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"results file {path}: not valid JSON: {exc}") from None
    if (
        not isinstance(payload, Mapping)
        or not isinstance(payload.get("cases"), list)
        or not isinstance(payload.get("environment"), Mapping)
    ):
        raise ValueError(
            f"results file {path}: expected the bench's results.json (an object "
            "with 'environment' and 'cases')"
        )
    return payload


def markdown_tables(
    results_paths: Sequence[str | os.PathLike], *, baseline: str = "torch", ours: str = "distmoe"
) -> str:
    """Markdown tables of bench results, one per device, from ``results.json`` files.

    Files are grouped by the GPU named in their environment block. Where several files of
    one device hold the same case (shape, T, widths, EP, precision, mode, routing), the
    newest file's (``date_utc``) is shown. A row gives the ``ours`` provider's time, the
    ``baseline`` provider's, their ratio (baseline / ours: above 1 is faster than the
    baseline; only where both were timed the same way), ours in useful TFLOP/s and in percent
    of the dense bf16 matmul measured in the same run (burst clock, and sustained in
    brackets), and a footnote naming the file, its date, git SHA, timing method and command.
    Where the device's files hold eager figures (``timing_method`` ``cuda_eager`` or
    ``cpu``: ``--timing eager|both``, or an old file's eager fallback), the times are those
    of CUDA-graph replay and eager columns follow: both providers' eager times, their ratio,
    and both providers' host time per call (``sync`` where the calls wait for the GPU; blank,
    ``-``, in files without it). Files with graph figures only render as before. Shape names of older files are shown by their
    current names (:data:`LEGACY_SHAPE_NAMES`). Raises ``ValueError`` naming a file that is
    missing or is not a bench results file.
    """
    if isinstance(results_paths, (str, os.PathLike)):
        raise TypeError("results_paths must be a sequence of paths, got a single path")
    files = []
    for p in results_paths:
        path = Path(p)
        payload = _load_results(path)
        env = payload["environment"]
        files.append(
            dict(
                path=path,
                payload=payload,
                env=env,
                date=str(env.get("date_utc", "")),
                gpu=str(env.get("gpu", "unknown")),
            )
        )
    if not files:
        raise ValueError("results_paths is empty: give at least one results.json")
    blocks = []
    for gpu in sorted({f["gpu"] for f in files}):
        mine = sorted((f for f in files if f["gpu"] == gpu), key=lambda f: f["date"])
        # key -> provider -> (file, slot -> case): the newest file wins per case; a case's
        # rows of one file fill its slots (graph, eager: timing_slot)
        table: dict[tuple, dict[str, tuple[dict, dict[str, Mapping]]]] = {}
        for f in mine:
            for case in f["payload"]["cases"]:
                if case.get("provider") not in (ours, baseline):
                    continue
                if case.get("transport") not in (None, "", "peer"):
                    continue  # the tables show the peer transport (the default on one node)
                per = table.setdefault(_case_key(case), {})
                held = per.get(case["provider"])
                if held is None or held[0] is not f:
                    held = per[case["provider"]] = (f, {})
                held[1].setdefault(timing_slot(case), case)
        with_eager = any("eager" in slots for per in table.values()
                         for _, slots in per.values())
        used: list[dict] = []  # files in order of their first footnote
        keys = sorted(
            table,
            key=lambda k: (_MODE_ORDER.get(k[8], 9), k[0], k[1], k[6], k[9] != "exact", k[10]),
        )

        def figure(slots: Mapping[str, Mapping] | None, slot: str) -> tuple[Mapping | None,
                                                                           float | None]:
            case = (slots or {}).get(slot)
            ok = case is not None and case.get("status") == "ok"
            return case, (case.get("iter_ms") if ok else None)

        rows = []
        for key in keys:
            pair = table[key]
            mine_file, mine_slots = pair.get(ours, (None, None))
            base_file, base_slots = pair.get(baseline, (None, None))
            ref = next(iter((mine_slots or base_slots).values()))
            mine_case, ms = figure(mine_slots, "graph")
            base_case, base_ms = figure(base_slots, "graph")
            # within one timing method (an old file's eager fallback is no graph figure)
            same = (mine_case or {}).get("timing_method") == (base_case or {}).get(
                "timing_method")
            ratio = base_ms / ms if ms and base_ms and same else None
            mine_eager, eager_ms = figure(mine_slots, "eager")
            base_eager, base_eager_ms = figure(base_slots, "eager")
            eager_ratio = base_eager_ms / eager_ms if eager_ms and base_eager_ms else None
            notes = set()
            for f in (mine_file, base_file):
                if f is not None:
                    if not any(f is u for u in used):
                        used.append(f)
                    notes.add(next(i for i, u in enumerate(used, 1) if u is f))
            rated = mine_case if ms else (mine_eager if eager_ms else None)
            pct = _fmt(rated.get("pct_dense") if rated else None, ".0f")
            sustained = rated.get("pct_dense_sustained") if rated else None
            if pct != "-" and sustained is not None:
                pct += f" ({sustained:.0f})"
            shape = key[0]
            dims = f"{key[1]}, {key[2]}, {key[3]}, {key[4]}, {key[5]}"
            cells = [
                f"`{shape}`",
                dims,
                str(key[6]),
                _MODE_TEXT.get(key[8], key[8]),
                _routing_text(ref),
                _graph_text(ms, mine_case, mine_eager),
                _graph_text(base_ms, base_case, base_eager),
                _fmt(ratio, ".2f") + ("x" if ratio else ""),
                _fmt(rated.get("tflops") if rated else None, ".0f"),
                pct,
            ]
            if with_eager:
                cells += [
                    _fmt(eager_ms, ".3f"),
                    _fmt(base_eager_ms, ".3f"),
                    _fmt(eager_ratio, ".2f") + ("x" if eager_ratio else ""),
                    host_text(mine_eager),
                    host_text(base_eager),
                ]
            cells.append(", ".join(f"[{n}]" for n in sorted(notes)))
            rows.append(tuple(cells))
        dates = sorted(f["date"][:10] for f in used)
        span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
        timings = sorted({_timing_text(f["payload"], f["payload"]["cases"]) for f in used})
        count = len({len(f["env"].get("gpus") or [None]) for f in used})
        ratio_text = f"Ratio = {baseline} time / {ours} time."
        if with_eager:
            ratio_text = (
                f"Ratios = {baseline} time / {ours} time, each within one timing (graph: "
                f"CUDA-graph replay; eager: back-to-back eager calls; host: the host's time "
                f"per eager call, sync where the calls wait for the GPU). TFLOP/s and % dense "
                f"of the graph figure, else the eager one."
            )
        lines = [
            f"### {gpu}",
            "",
            f"Device: {gpu}; dates (UTC): {span}; timing: {'; '.join(timings)}; "
            f"{len(used)} results file{'s' if len(used) != 1 else ''}"
            f"{'' if count == 1 else ' (machines with different GPU counts)'}. "
            f"{ratio_text}",
            "",
        ]
        graph = " graph" if with_eager else ""
        titles = [
            "shape",
            "T, D, F, E, K",
            "EP",
            "mode",
            "routing",
            f"{ours}{graph} ms",
            f"{baseline}{graph} ms",
            f"{graph.strip()} ratio".strip(),
            "TFLOP/s",
            "% dense (sustained)",
        ]
        if with_eager:
            titles += [f"{ours} eager ms", f"{baseline} eager ms", "eager ratio",
                       f"{ours} host ms", f"{baseline} host ms"]
        titles.append("source")
        lines.append("| " + " | ".join(titles) + " |")
        lines.append(
            "|" + "|".join("---" if i < 5 else "--:" for i in range(len(titles) - 1)) + "|---|"
        )
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
        for n, f in enumerate(used, 1):
            env = f["env"]
            sha = str(env.get("git_sha", "unknown"))
            short = sha[:7] + ("-dirty" if sha.endswith("-dirty") else "")
            lines.append(
                f"[{n}] `{f['path'].as_posix()}`: {f['date']}, git {short}, torch "
                f"{env.get('torch', '?')}, triton {env.get('triton', '?')}, "
                f"{_timing_text(f['payload'], f['payload']['cases'])}: "
                f"`{_command_text(str(env.get('command', '')))}`"
            )
            lines.append("")
        blocks.append("\n".join(lines).rstrip())
    return "\n\n".join(blocks) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m distmoe.tools.bench.report --markdown FILE...``: print
    :func:`markdown_tables` of the given results files."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m distmoe.tools.bench.report",
        description="Render bench results.json files as markdown tables, one per device.",
    )
    parser.add_argument(
        "--markdown",
        nargs="+",
        required=True,
        metavar="FILE",
        help="results.json files of `python -m distmoe bench`",
    )
    args = parser.parse_args(argv)
    try:
        text = markdown_tables(args.markdown)
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
