"""``python -m distmoe bench``: the benchmark suite.

Default suite: ceilings, then the shapes ``dense-e32 qwen3-30b-a3b-t2048 qwen3-30b-a3b
deepseek-v3`` at their default T, forward and forward+backward, balanced routing, providers
distmoe / torch / torch_compile
(a few minutes on one GPU; benchmarks/README.md). ``--full`` adds every named shape,
imbalance 1 4 8, the micro-benchmarks with their long sweeps and the roofline model. One GPU
runs EP = 1 on a private one-rank process group; under ``torchrun`` the world is the EP group
(EP = world size) and rank 0 writes the outputs.

The suite needs a CUDA GPU: ``--device auto`` (the default) without one is an error (exit 2).
``--device cpu`` is for smoke runs of the harness: it runs only the ``smoke`` shape unless
``--shapes`` names others (then with a warning: hours on the CPU). ``--out`` and ``--archive``
are checked before anything is measured. Exit status: 0 when at least one case succeeded
(a line says how many failed), 1 when none did or the suite aborted, 2 for a usage error,
141 when the reader of stdout went away (``... | head``; no traceback). On the CPU the table
ends with a note that its times are the interpreter's.

Reports beside the suite: ``--tables FILE...`` (markdown tables per device from results.json
files, :func:`~distmoe.tools.bench.report.markdown_tables`), ``--replot RESULTS`` (the plots
and the table of a finished run again), ``--routing-micro`` (routing-table construction per
implementation, :mod:`~distmoe.tools.bench.routing_micro`). Old results files name shapes by
their old names (``issue-a``, ``issue-b``, ``fine``); these read them under the new ones.

Case order: shape -> tokens -> mode -> imbalance -> provider, so a provider built for one
(shape, tokens, mode) (a distmoe context, a torch.compile graph) serves every imbalance.

Timing (``--timing``, default ``both``): each case is timed under CUDA-graph replay and as
eager calls (the way users mostly call the layer), one row per figure in cases.csv and
results.json (``timing_method`` ``cuda_graph`` or ``cuda_eager``; ``cpu`` on the CPU, one
row); eager rows carry the host time per call (``host_ms``; empty, with the note
``host: sync (...)``, for a provider that makes the host wait for the GPU). A provider that
cannot be captured has an eager row only, noted ``graph: n/a (reason)``. ``--no-graph`` is
``--timing eager``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distmoe.tools import INTERPRETER_NOTE, quiet_on_closed_pipe
from distmoe.tools.bench import ceilings as ceilings_mod
from distmoe.tools.bench import micro as micro_mod
from distmoe.tools.bench import models, report
from distmoe.tools.bench.baseline import torch_moe
from distmoe.tools.bench.groups import (
    BenchGroup,
    init_single_process_group,
    init_torchrun_group,
    launched_by_torchrun,
)
from distmoe.tools.bench.providers import (
    DEFAULT_PROVIDERS,
    PROVIDERS,
    Provider,
    build_provider,
    make_step,
)
from distmoe.tools.bench.timing import (
    TIMING_CHOICES,
    ModeResults,
    TimingConfig,
    all_ranks_agree,
    benchmark_modes,
)
from distmoe.tools.bench.workloads import (
    DEFAULT_SHAPES,
    FULL_SHAPES,
    ROUTING_KINDS,
    SHAPES,
    LayerInputs,
    MoEShape,
    current_shape_name,
    make_layer_inputs,
    make_weights,
)

FULL_IMBALANCE = (1.0, 4.0, 8.0)
# 1 .. 65536 in quarter octaves (the modeled rate's curves, --roofline)
ROOFLINE_TOKENS = tuple(sorted({round(2 ** (i / 4)) for i in range(65)}))


DESCRIPTION = """\
Time distmoe's layer against a plain PyTorch implementation and against the GPU's own
limits measured in the same run; write CSV, JSON and PNG files and print a table.

Providers (what is timed):
  distmoe        distmoe.MoEContext, this library's layer
  torch          the same layer in plain PyTorch: rows gathered by expert, torch._grouped_mm
                 for both projections with SwiGLU between, a score-weighted index_add back
                 (EP > 1: all_to_all_single to exchange the rows)
  torch_compile  torch.compile of that function (static shapes)
  rowwise        the same layer written with distmoe.rowwise (the lower-level API:
                 dispatch_put, grouped_mm, SwiGLU, grouped_mm, combine_get)
  transformers   a third-party peer: Hugging Face transformers' experts implementation
                 "grouped_mm" (Qwen3MoeExperts) on the same weights and routing; one rank
                 only, "unavailable" where transformers does not import

Ceilings (measured first, rank 0; --no-ceilings skips them):
  dense bf16 matrix multiply (torch.mm, the best of three sizes) and the same in windows
  as long as a large case's (the clock a long run settles at); fp8 rowwise matrix
  multiply; device copy and device read of 2 GiB (memory bandwidth); peer write and read
  between two GPUs when two are visible. "% dense" in the table is a case's useful TFLOP/s over the
  dense bf16 ceiling.

Without a GPU: --device cpu runs the harness on the smoke shape (distmoe's kernels in
Triton's interpreter): its times say nothing about GPU speed."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` (a subparser of ``python -m distmoe``)."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--shapes",
        nargs="+",
        metavar="NAME",
        choices=[*SHAPES, "all"],
        help=f"named shapes (default: {' '.join(DEFAULT_SHAPES)}; 'all' = every GPU shape; "
        "--list prints them)",
    )
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=int,
        metavar="T",
        help="tokens per rank for every shape (default: each shape's own T)",
    )
    parser.add_argument(
        "--mode",
        choices=("fwd", "fwdbwd", "both"),
        default="both",
        help="forward (inference), forward+backward (training) or both (default)",
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "mxfp8", "fp8_block", "nvfp4", "mxfp4"),
        default="bf16",
        help="the distmoe provider's MoEConfig.precision (default bf16; its inference cases "
             "take weights prepared once per weight version; nvfp4 and mxfp4 are inference "
             "only: --mode fwd). The other providers run as they are (torch_fp8: rowwise FP8)",
    )
    parser.add_argument(
        "--transport",
        nargs="+",
        choices=("auto", "peer", "nccl", "hierarchical"),
        default=["auto"],
        metavar="T",
        help="the distmoe provider's MoEContext transport, one case per value in one run "
             "(auto, peer, nccl, hierarchical; default auto: peer on one node). Rows name it "
             "in the transport column",
    )
    parser.add_argument(
        "--imbalance",
        nargs="+",
        type=float,
        metavar="F",
        help="tracked-group load factors (default 1; --full: 1 4 8)",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTING_KINDS,
        default="exact",
        help="exact: every expert gets exactly its share of the routes (the imbalance knob "
        "applies); sampled: each token draws its experts at random, balanced in expectation "
        "only, like a real router (no imbalance knob) (default exact)",
    )
    parser.add_argument(
        "--activation-factor",
        type=float,
        default=None,
        metavar="F",
        help="distmoe training cases: MoEConfig.activation_factor, the saved-state slot as a "
        "multiple of the balanced state (default: the config's, 1.0). An imbalanced case "
        "whose loaded rank exceeds the slot replays its layer in backward (a second "
        "forward); give at least the largest --imbalance to time saved layers only",
    )
    parser.add_argument(
        "--drop-route-outputs",
        action="store_true",
        help="distmoe training cases: MoEConfig.save_route_outputs=False, saved layers keep "
        "no returned route results in their slot (smaller slots, same gradients)",
    )
    parser.add_argument(
        "--regather-rows",
        action="store_true",
        help="distmoe training cases: MoEConfig.save_gathered_rows=False, saved layers keep "
        "their input instead of their gathered rows (smaller slots, same gradients; the "
        "backward gathers the rows again)",
    )
    parser.add_argument(
        "--rows-in-place",
        choices=["auto", "on", "off"],
        default="auto",
        help="with --regather-rows: MoEConfig.gathered_rows_in_place (auto: None, the "
        "library's rule; on: the W13 WGRAD reads the rows in place at EP=1; off: copied)",
    )
    parser.add_argument(
        "--imbalance-groups",
        type=int,
        default=8,
        metavar="G",
        help="EP=1 only: expert groups of the imbalance knob; group 0 stands for "
        "rank 0's experts at EP=G (default 8)",
    )
    parser.add_argument(
        "--rank-share-of",
        type=int,
        default=1,
        metavar="N",
        help="EP=1 only: run each shape with E/N experts, one rank's work at EP=N under "
        "balanced routing (T tokens, T*K rows, E/N local experts); the EP=1 side of an "
        "EP=N scaling comparison (default 1: the shape as named)",
    )
    parser.add_argument(
        "--providers",
        nargs="+",
        choices=PROVIDERS,
        default=list(DEFAULT_PROVIDERS),
        help="implementations to time: distmoe, torch (plain PyTorch), torch_compile "
        "(torch.compile of it) (default: all)",
    )
    parser.add_argument(
        "--micro",
        action="store_true",
        help="also run micro-benchmarks of grouped matrix multiplies: grouped against "
        "capacity-padded batched, a grouped projection against the matched dense one, and "
        "the effect of the expert histogram",
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="also write a roofline model: the modeled rate of the layer's two projections "
        "against the token count, for a dense layer and for the MoE layer (CSV and plot)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="all shapes, imbalance 1 4 8, the micro-benchmarks with long sweeps, the "
        "roofline model",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="output directory (default out/bench-<UTC time>)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="warm-up iterations (default 10)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (default 5)")
    parser.add_argument("--iters", type=int, default=30, help="iterations per window (default 30)")
    parser.add_argument(
        "--capture-iters",
        type=int,
        default=None,
        help="iterations per CUDA graph (default: one window; 1 = replay a one-step graph)",
    )
    parser.add_argument(
        "--timing",
        choices=TIMING_CHOICES,
        default=None,
        help="graph: CUDA-graph replay (a provider that cannot be captured: eager calls); "
        "eager: back-to-back eager calls between CUDA events, the same windows, plus the "
        "host's time per call (issued behind a GPU sleep; 'sync' for a provider that waits "
        "for the GPU); both: each case both ways, side by side (default both; on the CPU "
        "there is one timing, wall time per call)",
    )
    parser.add_argument(
        "--no-graph",
        action="store_true",
        help="alias of --timing eager (no CUDA graphs, also for the ceilings)",
    )
    parser.add_argument(
        "--no-ceilings",
        action="store_true",
        help="skip the ceiling measurements (dense matmul, copies; see above)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--archive",
        metavar="FILE",
        help="also pack every written file into this .tar.gz (one file to copy back)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto/cuda: the CUDA GPU (an error without one); cpu: smoke runs of the harness, "
        "the smoke shape only unless --shapes names others (default auto)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of inputs and routing")
    parser.add_argument(
        "--git-sha",
        metavar="SHA",
        help="record this commit (for copies of the tree without .git; default: git rev-parse)",
    )
    seed = parser.add_argument_group("the seed's evaluation (--suite seed)")
    seed.add_argument(
        "--suite",
        choices=("seed",),
        help="seed: seed 002's evaluation cases at one-GPU sizes instead of the shapes "
        "(imbalance 1 4 8 in bf16 and mxfp8 forward, an expert-width sweep, the ten-layer "
        "packing workload with and without a shared expert; seed_suite.py, "
        "benchmarks/README.md). Takes no --shapes or --tokens; --imbalance replaces 1 4 8; "
        "on the CPU it runs tiny widths",
    )
    seed.add_argument(
        "--seed-cases",
        nargs="+",
        metavar="KIND",
        help="with --suite seed: the kinds to run, among imbalance width packing "
        "packing-shared (default all)",
    )
    seed.add_argument(
        "--pack-layers",
        type=int,
        default=10,
        metavar="N",
        help="with --suite seed: layers of the packing workload (default 10, the seed's)",
    )
    other = parser.add_argument_group("reports instead of the suite")
    only = other.add_mutually_exclusive_group()
    only.add_argument("--list", action="store_true", help="list the named shapes and exit")
    only.add_argument(
        "--tables",
        nargs="+",
        metavar="FILE",
        help="print markdown tables of these results.json files, one per device (newest "
        "file per case; ratio = torch time / distmoe time)",
    )
    only.add_argument(
        "--replot",
        metavar="RESULTS",
        help="redraw the plots and reprint the table of a finished run from its results.json "
        "(into --out, default beside it)",
    )
    only.add_argument(
        "--routing-micro",
        action="store_true",
        help="time the routing-table construction per implementation (torch ops, one Triton "
        "program, blocked Triton) over --shapes (default: qwen3-30b-a3b dense-e32) and "
        "--tokens (default: 16 128 512 4096)",
    )
    other.add_argument(
        "--routing-ep",
        type=int,
        default=1,
        metavar="N",
        help="with --routing-micro: the ranks whose ids rank 0 reads (default 1)",
    )
    return parser


@dataclass(frozen=True, kw_only=True)
class BenchPlan:
    """Resolved options: what to run."""

    shapes: tuple[MoEShape, ...]
    tokens: tuple[int, ...] | None
    modes: tuple[str, ...]
    imbalances: tuple[float, ...]
    providers: tuple[str, ...]
    micro: bool
    micro_full: bool
    roofline: bool
    timing: TimingConfig
    timing_mode: str = "both"
    seed: int = 0
    imbalance_groups: int = 8
    routing: str = "exact"
    activation_factor: float | None = None
    save_route_outputs: bool = True
    save_gathered_rows: bool = True
    gathered_rows_in_place: bool | None = None
    suite: str = ""
    seed_kinds: tuple[str, ...] = ()
    pack_layers: int = 10
    precision: str = "bf16"
    transports: tuple[str, ...] = ("auto",)

    def case_providers(self) -> list[tuple[str, str]]:
        """``(provider, transport)`` of every provider case: distmoe once per transport, the
        others once (transport ``""``)."""
        return [(p, t) for p in self.providers
                for t in (self.transports if p == "distmoe" else ("",))]

    def tokens_for(self, shape: MoEShape) -> tuple[int, ...]:
        return self.tokens if self.tokens else (shape.tokens,)

    def num_cases(self) -> int:
        if self.suite == "seed":
            from distmoe.tools.bench import seed_suite

            cases = seed_suite.seed_cases(self.seed_kinds, layers=self.pack_layers,
                                          imbalances=self.imbalances)
            return seed_suite.count_rows(cases, self.providers)
        return (
            sum(len(self.tokens_for(s)) for s in self.shapes)
            * len(self.modes)
            * len(self.imbalances)
            * len(self.case_providers())
        )


def resolve_timing(args: argparse.Namespace) -> str:
    """``--timing`` with ``--no-graph`` as its alias ``eager`` (default ``both``); ValueError
    when the two say different things."""
    timing = getattr(args, "timing", None)
    if getattr(args, "no_graph", False):
        if timing not in (None, "eager"):
            raise ValueError(f"--no-graph is --timing eager; it contradicts --timing {timing}")
        return "eager"
    return timing or "both"


def rank_share(shape: MoEShape, ranks: int) -> MoEShape:
    """``shape`` with ``E / ranks`` experts, named ``<name>/ep<ranks>`` (``shape`` itself for
    one rank): what one rank computes at EP = ``ranks`` with balanced routing, run on one GPU."""
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--rank-share-of ({ranks!r}) must be an int >= 1")
    if ranks == 1:
        return shape
    if shape.num_experts % ranks or shape.num_experts // ranks < shape.top_k:
        raise ValueError(
            f"--rank-share-of ({ranks}) must divide the experts of shape {shape.name!r} "
            f"(E={shape.num_experts}) and leave at least top_k ({shape.top_k}) of them"
        )
    return dataclasses.replace(
        shape,
        name=f"{shape.name}/ep{ranks}",
        num_experts=shape.num_experts // ranks,
        description=f"{shape.description}, one rank's share at EP={ranks}",
    )


def resolve_plan(args: argparse.Namespace) -> BenchPlan:
    """Turn parsed arguments into a :class:`BenchPlan` (``--full`` fills what was not given)."""
    suite = getattr(args, "suite", None) or ""
    seed_kinds: tuple[str, ...] = ()
    if suite:
        from distmoe.tools.bench import seed_suite

        given = [f"--{n.replace('_', '-')}" for n in ("shapes", "tokens")
                 if getattr(args, n) is not None] + (["--full"] if args.full else [])
        if given:
            raise ValueError(f"--suite {suite} chooses its own shapes; drop "
                             f"{' '.join(given)}")
        seed_kinds = tuple(dict.fromkeys(args.seed_cases or seed_suite.SEED_KINDS))
        seed_suite.seed_cases(seed_kinds, layers=args.pack_layers)  # ValueError when bad
    elif args.seed_cases or args.pack_layers != 10:
        raise ValueError("--seed-cases and --pack-layers need --suite seed")
    if suite:
        names = ()  # the suite's own (seed_suite.seed_cases)
    elif args.shapes is None:
        names = FULL_SHAPES if args.full else DEFAULT_SHAPES
    elif "all" in args.shapes:  # and any other named shape (e.g. smoke) after them
        names = tuple(dict.fromkeys((*FULL_SHAPES, *(n for n in args.shapes if n != "all"))))
    else:
        names = tuple(dict.fromkeys(args.shapes))
    imbalances = args.imbalance or (FULL_IMBALANCE if args.full or suite else (1.0,))
    if any(not f >= 1 for f in imbalances):
        raise ValueError(f"--imbalance values ({imbalances}) must be >= 1")
    if args.imbalance_groups < 1:
        raise ValueError(f"--imbalance-groups ({args.imbalance_groups}) must be >= 1")
    if args.routing == "sampled" and any(f != 1.0 for f in imbalances):
        raise ValueError(
            f"--imbalance ({' '.join(f'{f:g}' for f in imbalances)}) needs --routing exact: "
            "sampled routing is balanced in expectation only"
        )
    if args.rows_in_place != "auto" and not args.regather_rows:
        raise ValueError(f"--rows-in-place {args.rows_in_place} needs --regather-rows (it "
                         "chooses how a kept input's rows are read)")
    if args.activation_factor is not None and not args.activation_factor > 0:
        raise ValueError(f"--activation-factor ({args.activation_factor}) must be > 0")
    if args.precision in ("nvfp4", "mxfp4") and args.mode != "fwd":
        raise ValueError(f"--precision {args.precision} is inference only: it needs --mode fwd")
    if args.tokens and any(t < 1 for t in args.tokens):
        raise ValueError(f"--tokens values ({args.tokens}) must be >= 1")
    shapes = tuple(rank_share(SHAPES[n], args.rank_share_of) for n in names)
    timing_mode = resolve_timing(args)
    capture = args.capture_iters if args.capture_iters is not None else args.iters
    timing = TimingConfig(
        num_warmup=args.warmup,
        num_windows=args.windows,
        iters_per_window=args.iters,
        capture_iters=capture,
        use_cuda_graph=timing_mode != "eager",
    )
    return BenchPlan(
        shapes=shapes,
        tokens=tuple(args.tokens) if args.tokens else None,
        modes=("fwd", "fwdbwd") if args.mode == "both" else (args.mode,),
        imbalances=tuple(float(f) for f in imbalances),
        providers=tuple(dict.fromkeys(args.providers)),
        micro=args.micro or args.full,
        micro_full=args.full,
        roofline=args.roofline or args.full,
        timing=timing,
        timing_mode=timing_mode,
        seed=args.seed,
        imbalance_groups=args.imbalance_groups,
        routing=args.routing,
        activation_factor=args.activation_factor,
        save_route_outputs=not args.drop_route_outputs,
        save_gathered_rows=not args.regather_rows,
        gathered_rows_in_place={"auto": None, "on": True, "off": False}[args.rows_in_place],
        suite=suite,
        seed_kinds=seed_kinds,
        pack_layers=args.pack_layers,
        precision=args.precision,
        transports=tuple(dict.fromkeys(args.transport)),
    )


# ----------------------------------------------------------------------------- one case


def _rel_err(y: torch.Tensor, y_ref: torch.Tensor | None) -> float | None:
    if y_ref is None:
        return None
    scale = y_ref.float().abs().max().item()
    return (y.float() - y_ref.float()).abs().max().item() / (scale if scale > 0 else 1.0)


@dataclass
class _Context:
    plan: BenchPlan
    device: torch.device
    bench_group: BenchGroup
    dense_tflops: float | None
    dense_sustained_tflops: float | None = None


def _base_result(
    ctx: _Context, provider: str, shape: MoEShape, tokens: int, mode: str, imbalance: float,
    transport: str = "",
) -> report.CaseResult:
    return report.CaseResult(
        provider=provider,
        transport=transport,
        status="ok",
        shape=shape.name,
        tokens=tokens,
        hidden=shape.hidden,
        ffn=shape.ffn,
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        ep_size=ctx.bench_group.world_size,
        imbalance=imbalance,
        # the bytes model's precision: distmoe's, torch_fp8's rowwise FP8 as block FP8's
        precision={"distmoe": ctx.plan.precision, "torch_fp8": "fp8_block"}.get(provider,
                                                                              "bf16"),
        mode=mode,
    )


def case_work(row: report.CaseResult) -> tuple[float, float, float]:
    """Useful FLOPs, modeled HBM bytes and modeled NVLink bytes of one iteration of ``row``."""
    kw = {"tokens": row.tokens, "hidden": row.hidden, "top_k": row.top_k, "mode": row.mode}
    flops = models.useful_flops(ffn=row.ffn, **kw)
    hbm = models.modeled_hbm_bytes(
        ffn=row.ffn, num_local_experts=row.num_experts // row.ep_size,
        precision=row.precision or "bf16", active_experts=row.active_experts, **kw
    )
    nvlink = models.nvlink_bytes(ep_size=row.ep_size, **kw).total
    return flops, hbm, nvlink


def fill_metrics(row: report.CaseResult, dense_tflops: float | None,
                 dense_sustained_tflops: float | None = None) -> float:
    """Rates of ``row`` from its iteration time; returns the modeled intensity (FLOP/byte)."""
    flops, hbm, nvlink = case_work(row)
    row.tflops = models.per_second(flops, row.iter_ms) / 1e12
    row.hbm_gbps = models.per_second(hbm, row.iter_ms) / 1e9
    row.nvlink_gbps = models.per_second(nvlink, row.iter_ms) / 1e9
    if dense_tflops:
        row.pct_dense = 100.0 * row.tflops / dense_tflops
    if dense_sustained_tflops:
        row.pct_dense_sustained = 100.0 * row.tflops / dense_sustained_tflops
    return flops / hbm


def run_case(
    ctx: _Context,
    provider: Provider,
    inputs: LayerInputs,
    row: report.CaseResult,
    y_ref: torch.Tensor | None,
) -> list[tuple[report.CaseResult, float | None]]:
    """Time one provider on one set of inputs.

    Returns one row per figure measured (graph, then eager: :func:`case_rows`), each with its
    modeled intensity (FLOP/byte), or ``[(row, None)]`` with ``row`` filled as a provider that
    is not ok or a failed case. ``row`` is the template of the rows (and the first of them)."""
    start = time.perf_counter()
    row.baseline_path = provider.baseline_path
    row.routing = ctx.plan.routing
    row.achieved_imbalance = inputs.routing.achieved_imbalance
    row.tracked_rows = inputs.routing.tracked_rows
    if row.ep_size == 1:  # the experts whose weights a call reads (decode: a few of them)
        row.active_experts = sum(c > 0 for c in inputs.routing.rows_per_expert_E)
    if provider.status != "ok":
        row.status, row.note = provider.status, provider.note
        return [(row, None)]
    step = make_step(provider.layer, inputs, row.mode)
    args = (inputs.x_TD, inputs.expert_ids_TK, inputs.scores_TK, inputs.w13_e2FD, inputs.w2_eDF)
    try:
        # Priming (torch.compile compiles here, untimed) and a numerical check of the forward
        # output against the torch baseline. Training mode primes with a whole step: a
        # forward with grad whose output is dropped would leave distmoe's layer in its slot.
        with torch.no_grad():
            y = provider.layer(*args).detach()
        row.max_rel_err_vs_torch = _rel_err(y, y_ref)
        del y
        if row.mode == "fwdbwd":
            step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        group = ctx.bench_group.group if ctx.bench_group.world_size > 1 else None
        res = benchmark_modes(
            step,
            timing=ctx.plan.timing_mode,
            config=ctx.plan.timing,
            group=group,
            device=ctx.device,
            graph_safe=provider.graph_safe,
        )
        if ctx.device.type == "cuda":
            # plus the symmetric heap's buffers where its allocator is not torch's (distmoe's
            # dispatch, combine and activation buffers under symmetric memory)
            heap = getattr(provider.layer, "heap", None)
            untracked = heap.untracked_bytes if heap is not None else 0
            row.peak_mem_gib = (torch.cuda.max_memory_allocated(ctx.device) + untracked) / 2**30
        rows = case_rows(row, res, provider.note)
        if ctx.bench_group.world_size > 1:
            _measure_nvlink(ctx, step, rows, group)
        out = [(r, fill_metrics(r, ctx.dense_tflops, ctx.dense_sustained_tflops)) for r in rows]
    except Exception as exc:  # a failing provider is a result, not a harness error
        row.status, row.note = "failed", report.error_text(exc)
        out = [(row, None)]
    seconds = time.perf_counter() - start
    for r, _ in out:
        r.case_seconds = seconds
    return out


#: Largest ``max|y - y_torch| / max|y_torch|`` a provider's forward may show against the bf16
#: torch baseline before its row is flagged, per precision: a check that catches a broken
#: kernel, not an accuracy claim (docs/numerics.md holds the bounds). bf16: summation order
#: and bf16 roundings. FP8 (E4M3, 3 fraction bits): each of the four GEMM operands (x, w13,
#: h2, w2) carries up to 2^-4 relative error, so without cancellation the output errs by up to
#: 4 * 2^-4 of its scale. FP4 weights (E2M1, 1 fraction bit): 2^-2 per weight, two GEMMs.
OUTPUT_TOLERANCE = {"bf16": 0.05, "mxfp8": 0.25, "fp8_block": 0.25, "nvfp4": 0.5,
                    "mxfp4": 0.5}


def _measure_nvlink(ctx: _Context, step, rows: list[report.CaseResult], group) -> None:
    """NVLink bytes of one case measured through NVML GPM (:mod:`.nvlink`), collectively: every
    rank runs the measuring calls or none does. Each row gets ``nvlink_measured_gbps`` at its
    own iteration time, or a note saying why there is none."""
    from . import nvlink

    counter, why = nvlink.counter_for(ctx.device)
    if not all_ranks_agree(counter is not None, group):
        why = why or "another rank cannot measure"
        for r in rows:
            r.note = "; ".join(filter(None, [r.note, f"nvlink measured: n/a ({why})"]))
        return
    link = counter.measure(step, ctx.plan.timing.iters_per_window, ctx.device)
    for r in rows:
        if r.iter_ms:
            r.nvlink_measured_gbps = link.per_direction / (r.iter_ms * 1e-3) / 1e9


def case_rows(row: report.CaseResult, res: ModeResults, provider_note: str = ""
              ) -> list[report.CaseResult]:
    """The rows of one timed case: ``row`` (the template) filled with the graph figure, then a
    copy with the eager one, as far as ``res`` holds them.

    Notes, in order: the provider's, ``graph: n/a (reason)`` on the eager row of a case
    whose graph figure was asked for but could not be taken, ``host: sync (...)`` on an
    eager row whose calls made the host wait for the GPU (``host_ms`` NaN: an empty cell),
    and ``OUTPUT DIFFERS FROM TORCH BASELINE``."""
    rows = []
    for i, r in enumerate(res.results()):
        out = row if i == 0 else dataclasses.replace(row, window_ms=[])
        out.timing_method = r.method
        out.iter_ms, out.window_min_ms, out.window_max_ms = (
            r.stats.iter_ms, r.stats.min_ms, r.stats.max_ms)
        out.window_ms = list(r.stats.window_ms)
        if r.telemetry is not None:
            out.sm_clock_mhz, out.power_w = r.telemetry.sm_clock_mhz, r.telemetry.power_w
        else:
            out.sm_clock_mhz = out.power_w = None
        notes = [provider_note] if provider_note else []
        if r is res.eager and res.graph_reason:
            notes.append(f"{report.GRAPH_NA_NOTE} ({res.graph_reason})")
        out.host_ms = None
        if r.host is not None:
            out.host_ms = r.host.ms
            if r.host.synced:
                notes.append(f"{report.HOST_SYNC_NOTE} (the calls made the host wait for the "
                             "GPU: it could not issue them ahead of a queued GPU sleep)")
        tol = OUTPUT_TOLERANCE.get(out.precision or "bf16", OUTPUT_TOLERANCE["bf16"])
        if out.max_rel_err_vs_torch is not None and out.max_rel_err_vs_torch > tol:
            notes.append(f"OUTPUT DIFFERS FROM TORCH BASELINE (max error "
                         f"{out.max_rel_err_vs_torch:.3g} of max |y| > {tol} at "
                         f"{out.precision or 'bf16'})")
        out.note = "; ".join(notes)
        rows.append(out)
    return rows


# ----------------------------------------------------------------------------- the suite


def _reference_output(inputs: LayerInputs, ctx: _Context) -> torch.Tensor | None:
    group = ctx.bench_group.group if ctx.bench_group.world_size > 1 else None
    try:
        with torch.no_grad():
            return torch_moe(
                inputs.x_TD,
                inputs.expert_ids_TK,
                inputs.scores_TK,
                inputs.w13_e2FD,
                inputs.w2_eDF,
                group=group,
            )
    except Exception:
        return None


def run_cases(
    ctx: _Context,
    results: list[report.CaseResult],
    intensity: dict[int, float],
    progress=None,
    on_case=None,
) -> None:
    """Every case of the plan, appended to ``results`` as it finishes (so a crash keeps what
    was measured); ``intensity[id(row)]`` receives each timed case's modeled FLOP/byte."""
    plan, bg = ctx.plan, ctx.bench_group
    # EP > 1: group 0 is rank 0's experts; EP = 1: the configured number of expert groups.
    groups = bg.world_size if bg.world_size > 1 else plan.imbalance_groups
    for shape in plan.shapes:
        if shape.num_experts % bg.world_size:
            for t in plan.tokens_for(shape):
                for mode in plan.modes:
                    for f in plan.imbalances:
                        for p, tr in plan.case_providers():
                            row = _base_result(ctx, p, shape, t, mode, f, tr)
                            row.status = "skipped"
                            row.note = (f"num_experts {shape.num_experts} not divisible "
                                        f"by EP {bg.world_size}")
                            results.append(row)
                            if progress:
                                progress.update(1)
            continue
        weights = make_weights(
            shape,
            num_local_experts=shape.num_experts // bg.world_size,
            device=ctx.device,
            seed=plan.seed + 11 + 1000 * bg.rank,
        )
        for t in plan.tokens_for(shape):
            for mode in plan.modes:
                training = mode == "fwdbwd"
                if "torch_compile" in plan.providers:
                    import torch._dynamo

                    torch._dynamo.reset()  # new static shapes: start from an empty cache
                built: dict[tuple[str, str], Provider] = {}
                for f in plan.imbalances:
                    try:
                        inputs = make_layer_inputs(
                            shape,
                            tokens=t,
                            ep_size=bg.world_size,
                            rank=bg.rank,
                            imbalance=f,
                            num_groups=groups,
                            training=training,
                            device=ctx.device,
                            seed=plan.seed,
                            weights=weights,
                            routing_kind=plan.routing,
                        )
                    except ValueError as exc:
                        for p, tr in plan.case_providers():
                            row = _base_result(ctx, p, shape, t, mode, f, tr)
                            row.status, row.note = "infeasible", str(exc)
                            results.append(row)
                            if progress:
                                progress.update(1)
                        continue
                    y_ref = _reference_output(inputs, ctx)
                    for p, tr in plan.case_providers():
                        if (p, tr) not in built:
                            built[p, tr] = build_provider(
                                p,
                                shape=shape,
                                tokens=t,
                                training=training,
                                bench_group=bg,
                                device=ctx.device,
                                max_imbalance=max(plan.imbalances),
                                activation_factor=plan.activation_factor,
                                save_route_outputs=plan.save_route_outputs,
                                save_gathered_rows=plan.save_gathered_rows,
                                gathered_rows_in_place=plan.gathered_rows_in_place,
                                precision=plan.precision,
                                transport=tr or "auto",
                            )
                        prov = built[p, tr]
                        row = _base_result(ctx, p, shape, t, mode, f,
                                           prov.transport or tr)
                        for r, value in run_case(ctx, prov, inputs, row, y_ref):
                            if value is not None:
                                intensity[id(r)] = value
                            results.append(r)
                        if on_case is not None:
                            on_case()
                        if progress:
                            progress.update(1)
                            progress.set_postfix_str(
                                f"{shape.name} T{t} {mode} x{f:g} {p}"
                                + (f" {tr}" if tr else ""), refresh=False
                            )
                    del inputs, y_ref
                for prov in built.values():
                    try:
                        prov.close()
                    except Exception:
                        pass
                del built
                _free(ctx.device)
        del weights
        _free(ctx.device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_micro(device: torch.device, timing: TimingConfig, full: bool) -> tuple[list[dict], dict]:
    """The three micro-benchmarks; failures are recorded, not raised."""
    rows: list[dict] = []
    summary: dict = {}
    if device.type != "cuda":
        return rows, {"note": "micro-benchmarks need CUDA"}
    try:
        gv, crossings = micro_mod.grouped_vs_bmm(device, timing)
        rows += [r.as_dict() for r in gv]
        summary["grouped_vs_bmm_crossover"] = {
            str(d): (list(c) if c else None) for d, c in crossings.items()
        }
    except Exception as exc:
        summary["grouped_vs_bmm_error"] = report.error_text(exc)
    _free(device)
    try:
        tokens = micro_mod.MATCHED_TOKENS_FULL if full else micro_mod.MATCHED_TOKENS_DEFAULT
        rows += [r.as_dict() for r in micro_mod.matched_projection(device, timing, tokens=tokens)]
    except Exception as exc:
        summary["matched_projection_error"] = report.error_text(exc)
    _free(device)
    try:
        bases = (0, 3, 6, 9, 12) if full else (0,)
        rows += [r.as_dict() for r in micro_mod.histogram_effect(device, timing, bases=bases)]
    except Exception as exc:
        summary["histogram_error"] = report.error_text(exc)
    _free(device)
    return rows, summary


def roofline_model(
    shapes: tuple[MoEShape, ...],
    peak_flops: float,
    bytes_per_s: float,
    marks: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, list[dict]]:
    """Eq. 94 curves for the seed's configuration (N64 K4 d=h=4096) and each selected shape.

    ``marks[name]`` token counts are added to that shape's curve (the T it was benchmarked at).
    """
    configs = {"seed N64 K4 d=h=4096": (64, 4, 4096, 4096)}
    for s in shapes:
        configs[s.name] = (s.num_experts, s.top_k, s.hidden, s.ffn)
    curves = {}
    for name, (n, k, d, h) in configs.items():
        tokens = sorted(set(ROOFLINE_TOKENS) | set((marks or {}).get(name, ())))
        pts = models.roofline_curve(
            tokens, top_k=k, num_experts=n, d=d, h=h, peak_flops=peak_flops, bytes_per_s=bytes_per_s
        )
        curves[name] = [
            {"tokens": p.tokens, "dense_fraction": p.dense_fraction, "moe_fraction": p.moe_fraction}
            for p in pts
        ]
    return curves


class _TextProgress:
    """Stand-in for tqdm when it is not installed: one line per finished case on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.postfix = total, 0, ""

    def update(self, n: int) -> None:
        self.done += n

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        print(f"bench [{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextProgress(total)
    return tqdm(total=total, desc="bench", unit="case", file=sys.stderr)


NO_GPU_ERROR = (
    "bench needs a CUDA GPU (none found); for a harness smoke run on CPU: "
    "--device cpu --shapes smoke --providers torch"
)
# Shapes --device cpu runs without being named on the command line.
CPU_SHAPES = ("smoke",)


def _select_device(choice: str) -> torch.device:
    """``--device``: auto and cuda need CUDA (ValueError without it); cpu is the CPU."""
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if choice == "auto":
            raise ValueError(NO_GPU_ERROR)
        raise ValueError("--device cuda requested but CUDA is not available")
    return torch.device("cuda", torch.cuda.current_device())


def check_cpu_shapes(args: argparse.Namespace) -> str:
    """The ``--device cpu`` rule: shapes other than :data:`CPU_SHAPES` run only when
    ``--shapes`` names them. Raises ValueError for shapes the command line did not name (the
    default suite, ``--full``, ``--shapes all``); returns a warning for named GPU-sized shapes
    ('' when none, and always '' for other devices)."""
    if args.device != "cpu" or getattr(args, "suite", None):
        return ""  # the seed suite runs tiny widths on the CPU
    if args.shapes is None or "all" in args.shapes:
        if args.shapes is not None:
            source, names = "--shapes all", FULL_SHAPES
        elif args.full:
            source, names = "--full", FULL_SHAPES
        else:
            source, names = "the default suite", DEFAULT_SHAPES
        raise ValueError(
            f"--device cpu runs shapes other than {' '.join(CPU_SHAPES)} only when --shapes "
            f"names them, and {source} selects {' '.join(names)} (GPU-sized: hours on the "
            "CPU); for a harness smoke run: --device cpu --shapes smoke --providers torch"
        )
    big = [n for n in dict.fromkeys(args.shapes) if n not in CPU_SHAPES]
    if not big:
        return ""
    return (
        f"--device cpu with GPU-sized shape(s) {' '.join(big)}: on the CPU (distmoe's kernels "
        "in the Triton interpreter) this will take very long, possibly hours"
    )


def _path_problem(path: Path) -> str:
    """Why no directory can be written at ``path`` ('' when it can: it is a writable
    directory, or its nearest existing ancestor is one, so it can be created)."""
    for p in (path, *path.parents):
        if not os.path.lexists(p):
            continue
        if not p.is_dir():
            return f"{p} is {'an existing file' if p.is_file() else 'not a directory'}"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"directory {p} is not writable"
        return ""
    return ""  # no ancestor exists (a relative path whose '.' is gone): mkdir will tell


def check_output_paths(out_dir: Path, archive: str | None) -> None:
    """Check ``--out`` (an existing writable directory or a creatable one) and ``--archive``
    (not a directory; its directory existing and writable or creatable) before anything is
    measured; ValueError names the option, the value and the problem."""
    problem = _path_problem(out_dir)
    if problem:
        raise ValueError(
            f"--out ({out_dir}) must be a writable directory or one that can be created: "
            f"{problem}"
        )
    if archive:
        path = Path(archive)
        if path.is_dir():
            raise ValueError(
                f"--archive ({archive}) must name a file to write, not an existing directory "
                f"(e.g. {path / 'bench.tar.gz'})"
            )
        problem = _path_problem(path.parent)
        if problem:
            raise ValueError(
                f"--archive ({archive}) must be in a writable directory or one that can be "
                f"created: {problem}"
            )


# The files a run writes into --out (the micro-benchmark plots only with --micro on a GPU).
OUTPUT_NAMES = (
    "cases.csv",
    "ceilings.csv",
    "micro.csv",
    "roofline_model.csv",
    "results.json",
    "tflops.png",
    "roofline.png",
    "seed.png",
    "roofline_model.png",
    "micro_grouped_vs_bmm.png",
    "micro_matched_projection.png",
    "micro_histogram.png",
)


def planned_outputs(plan: BenchPlan, device: torch.device, plots: bool) -> set[str]:
    """Names of :data:`OUTPUT_NAMES` this run may write (a plot only where it has data)."""
    names = {"cases.csv", "ceilings.csv", "results.json"}
    if plan.micro:
        names.add("micro.csv")
    if plan.roofline:
        names.add("roofline_model.csv")
    if plots:
        names |= {"tflops.png", "roofline.png"}
        if plan.suite == "seed":
            names.add("seed.png")
        if plan.roofline:
            names.add("roofline_model.png")
        if plan.micro and device.type == "cuda":
            names |= {n for n in OUTPUT_NAMES if n.startswith("micro_")}
    return names


def earlier_run_notice(out_dir: Path, planned: set[str]) -> str:
    """One line when ``out_dir`` holds output files of an earlier run: which ones this run
    replaces and which stay as they are (nothing is deleted); '' when it holds none."""
    present = [n for n in OUTPUT_NAMES if (out_dir / n).is_file()]
    if not present:
        return ""
    replaced = [n for n in present if n in planned]
    kept = [n for n in present if n not in planned]
    text = f"--out {out_dir} holds files of an earlier run; this run replaces: " + (
        " ".join(replaced) if replaced else "none of them"
    )
    if kept:
        text += f"; keeps (not written by this run): {' '.join(kept)}"
    return text + "; nothing is deleted"


def run(args: argparse.Namespace) -> int:
    """Run the suite described by ``args`` (from :func:`add_arguments`); returns an exit code."""
    if args.list:
        for s in SHAPES.values():
            print(
                f"{s.name:<18} T{s.tokens:<6} D{s.hidden:<5} F{s.ffn:<5} E{s.num_experts:<4} "
                f"K{s.top_k:<2} {s.description}"
            )
        return 0
    if args.routing_ep != 1 and not args.routing_micro:
        print(f"distmoe bench: error: --routing-ep ({args.routing_ep}) needs --routing-micro",
              file=sys.stderr)
        return 2
    if args.tables:
        return print_tables(args.tables)
    if args.replot:
        return replot(Path(args.replot), Path(args.out) if args.out else None)
    if args.routing_micro:
        return run_routing_micro(args)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out or f"out/bench-{stamp}")
    try:
        plan = resolve_plan(args)
        device = _select_device(args.device)
        warning = check_cpu_shapes(args)
        check_output_paths(out_dir, args.archive)
    except ValueError as exc:
        print(f"distmoe bench: error: {exc}", file=sys.stderr)
        return 2
    if warning:
        print(f"distmoe bench: warning: {warning}", file=sys.stderr)
    if launched_by_torchrun():
        if args.rank_share_of != 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            print(f"distmoe bench: error: --rank-share-of ({args.rank_share_of}) is for EP=1 "
                  "runs; under torchrun each rank already runs its share", file=sys.stderr)
            return 2
        bench_group, device = init_torchrun_group(device.type)
    else:
        bench_group = init_single_process_group(device)
    is_rank0 = bench_group.rank == 0
    try:
        return _run(args, plan, device, bench_group, is_rank0, out_dir)
    finally:
        bench_group.close()


# ----------------------------------------------------------------------------- other reports


def print_tables(paths: list[str]) -> int:
    """``--tables``: :func:`report.markdown_tables` of the results files; exit status."""
    try:
        text = report.markdown_tables(paths)
    except ValueError as exc:
        print(f"distmoe bench: error: --tables: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def replot(results: Path, out: Path | None = None) -> int:
    """``--replot``: the plots (into ``out``, default beside ``results``) and the table of a
    finished run from its results.json; old shape names read under the new ones. Exit
    status (2 for a file that is no results.json of a run)."""
    try:
        data = json.loads(results.read_text())
        cases = [report.CaseResult(**{**c, "shape": current_shape_name(c["shape"])})
                 for c in data["cases"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"distmoe bench: error: --replot {results}: not a readable results.json of a "
              f"bench run ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    out = out or results.parent
    out.mkdir(parents=True, exist_ok=True)
    ceilings = {c["name"]: c for c in data.get("ceilings", [])}
    dense = (ceilings.get("dense_bf16") or {}).get("value")
    model = data.get("roofline_model") or {}
    peak = model.get("peak_tflops") or dense or models.H200_BF16_DENSE_FLOPS / 1e12
    hbm = (model.get("hbm_gbps") or (ceilings.get("device_copy") or {}).get("value")
           or models.H200_HBM_BYTES_PER_S / 1e9)
    source = model.get("source") or ("measured" if dense else "H200 datasheet")
    intensity = {}
    for c in cases:
        flops, nbytes, _ = case_work(c)
        intensity[id(c)] = flops / nbytes
    written = [
        report.plot_tflops(cases, dense, out / "tflops.png"),
        report.plot_roofline(cases, peak_tflops=peak, hbm_gbps=hbm, intensity=intensity,
                             path=out / "roofline.png", source=source),
    ]
    curves = {current_shape_name(k): v for k, v in (model.get("curves") or {}).items()}
    if curves:
        marks: dict[str, set[int]] = {}
        for c in cases:
            marks.setdefault(c.shape, set()).add(c.tokens)
        written.append(report.plot_roofline_model(curves, source=source,
                                                  path=out / "roofline_model.png",
                                                  marks={k: tuple(sorted(v))
                                                         for k, v in marks.items()}))
    written.append(report.plot_seed(cases, out / "seed.png"))
    micro_rows = (data.get("micro") or {}).get("rows") or []
    written += report.plot_micro(micro_rows, out)
    print("wrote " + " ".join(str(p) for p in written if p is not None))
    print(report.format_table(cases, data.get("ceilings", [])))
    return 0


def run_routing_micro(args: argparse.Namespace) -> int:
    """``--routing-micro``: :func:`routing_micro.run` over ``--shapes`` and ``--tokens`` on
    ``--device`` (the CPU: the smoke shape unless named); exit status."""
    from distmoe.tools.bench import routing_micro

    try:
        device = _select_device(args.device)
        cpu = device.type == "cpu"
        shapes = tuple(dict.fromkeys(args.shapes or (
            ("smoke",) if cpu else routing_micro.DEFAULT_SHAPES)))
        if "all" in shapes:
            shapes = tuple(dict.fromkeys((*FULL_SHAPES, *(n for n in shapes if n != "all"))))
        tokens = tuple(args.tokens or ((8,) if cpu and not args.shapes else
                                       routing_micro.DEFAULT_TOKENS))
        routing_micro.check(shapes, tokens, args.routing_ep)
    except ValueError as exc:
        print(f"distmoe bench: error: {exc}", file=sys.stderr)
        return 2
    rows = routing_micro.run(shapes, tokens, args.routing_ep, device)
    if args.out and rows:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = report.write_csv(Path(args.out) / "routing_tables.csv", rows,
                                list(routing_micro.COLUMNS))
        print(f"wrote {path}")
    return 0


def _run(
    args,
    plan: BenchPlan,
    device: torch.device,
    bench_group: BenchGroup,
    is_rank0: bool,
    out_dir: Path,
) -> int:
    started = time.perf_counter()
    earlier: list[str] = []
    if is_rank0:
        notice = earlier_run_notice(out_dir, planned_outputs(plan, device, not args.no_plots))
        if notice:
            print(f"distmoe bench: note: {notice}", file=sys.stderr, flush=True)
            earlier = [n for n in OUTPUT_NAMES if (out_dir / n).is_file()]
        out_dir.mkdir(parents=True, exist_ok=True)
    env = report.environment()
    if args.git_sha:
        env["git_sha"] = args.git_sha
    env["ep_size"] = bench_group.world_size
    env["device"] = str(device)

    # Ceilings first (rank 0 only; the other ranks wait).
    ceilings = ceilings_mod.Ceilings(items=[])
    if not args.no_ceilings and is_rank0:
        ceilings = ceilings_mod.measure_all(device, plan.timing)
    dense = ceilings.value("dense_bf16")
    dense_sustained = ceilings.value("dense_bf16_sustained")
    if bench_group.world_size > 1:
        box = [dense, dense_sustained]
        dist.broadcast_object_list(box, src=0)
        dense, dense_sustained = box

    ctx = _Context(plan=plan, device=device, bench_group=bench_group, dense_tflops=dense,
                   dense_sustained_tflops=dense_sustained)
    progress = _progress(plan.num_cases()) if is_rank0 else None
    cases: list[report.CaseResult] = []
    intensity: dict[int, float] = {}
    aborted = ""

    def checkpoint() -> None:
        # cases.csv after every case: a run killed at its time limit keeps what it measured
        if is_rank0:
            report.write_csv(
                out_dir / "cases.csv", (c.as_row() for c in cases), list(report.CASE_COLUMNS)
            )

    try:
        if plan.suite == "seed":
            from distmoe.tools.bench import seed_suite

            seed_suite.run(ctx, cases, intensity, progress, on_case=checkpoint,
                           cli=sys.modules[__name__])
        else:
            run_cases(ctx, cases, intensity, progress, on_case=checkpoint)
    except Exception as exc:  # keep and write what was measured before the failure
        aborted = f"suite aborted after {len(cases)} cases: {report.error_text(exc)}"
    finally:
        if progress is not None:
            progress.close()

    micro_rows, micro_summary = [], {}
    if plan.micro:
        if bench_group.world_size > 1:
            micro_summary = {"note": "micro-benchmarks run only in single-process runs"}
        elif is_rank0:
            micro_rows, micro_summary = run_micro(device, plan.timing, plan.micro_full)

    copy = ceilings.value("device_copy")
    peak_tflops = dense or models.H200_BF16_DENSE_FLOPS / 1e12
    hbm_gbps = copy or models.H200_HBM_BYTES_PER_S / 1e9
    source = (
        "measured"
        if dense and copy
        else "H200 datasheet"
        if not (dense or copy)
        else "mixed measured/datasheet"
    )
    marks = {s.name: plan.tokens_for(s) for s in plan.shapes}
    curves = (
        roofline_model(plan.shapes, peak_tflops * 1e12, hbm_gbps * 1e9, marks)
        if plan.roofline
        else {}
    )

    if not is_rank0:
        return 0
    written = [
        report.write_csv(
            out_dir / "cases.csv", (c.as_row() for c in cases), list(report.CASE_COLUMNS)
        ),
        report.write_csv(
            out_dir / "ceilings.csv",
            ceilings.as_dicts(),
            [
                "name",
                "value",
                "unit",
                "detail",
                "iter_ms",
                "window_min_ms",
                "window_max_ms",
                "method",
                "sm_clock_mhz",
                "power_w",
                "note",
            ],
        ),
    ]
    if plan.micro:
        written.append(report.write_csv(out_dir / "micro.csv", micro_rows, micro_mod.MICRO_COLUMNS))
    if curves:
        flat = [{"config": name, **p} for name, pts in curves.items() for p in pts]
        written.append(
            report.write_csv(
                out_dir / "roofline_model.csv",
                flat,
                ["config", "tokens", "dense_fraction", "moe_fraction"],
            )
        )
    payload = {
        "environment": env,
        "arguments": {k: v for k, v in vars(args).items() if not callable(v)},
        "timing": {
            "num_warmup": plan.timing.num_warmup,
            "num_windows": plan.timing.num_windows,
            "iters_per_window": plan.timing.iters_per_window,
            "capture_iters": plan.timing.capture_iters,
            "use_cuda_graph": plan.timing.use_cuda_graph,
            "mode": plan.timing_mode,
            "host_rounds": plan.timing.host_rounds,
        },
        "ceilings": ceilings.as_dicts(),
        "cases": [c.as_dict() for c in cases],
        "micro": {"rows": micro_rows, "summary": micro_summary},
        "roofline_model": {
            "source": source,
            "peak_tflops": peak_tflops,
            "hbm_gbps": hbm_gbps,
            "balance_point_flop_per_byte": models.balance_point(peak_tflops * 1e12, hbm_gbps * 1e9),
            "curves": curves,
        }
        if curves
        else {},
        "elapsed_s": time.perf_counter() - started,
        "aborted": aborted,
    }
    written.append(report.write_json(out_dir / "results.json", payload))
    plot_note = ""
    if not args.no_plots:
        try:
            for p in (
                report.plot_tflops(cases, dense, out_dir / "tflops.png"),
                report.plot_roofline(
                    cases,
                    peak_tflops=peak_tflops,
                    hbm_gbps=hbm_gbps,
                    intensity=intensity,
                    path=out_dir / "roofline.png",
                    source=source,
                ),
                report.plot_roofline_model(
                    curves, source=source, path=out_dir / "roofline_model.png", marks=marks
                )
                if curves
                else None,
                report.plot_seed(cases, out_dir / "seed.png") if plan.suite else None,
            ):
                if p is not None:
                    written.append(p)
            if micro_rows:
                written += report.plot_micro(micro_rows, out_dir)
        except Exception as exc:  # the CSV and JSON are already written; plots are extras
            plot_note = "plots incomplete: " + report.error_text(exc)
    archive_note = ""
    if args.archive:
        archive = Path(args.archive)
        try:  # checked before the run; a failure here keeps the summary below
            archive.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archive, "w:gz") as tar:
                for p in written:
                    tar.add(p, arcname=f"{out_dir.name}/{p.name}")
        except OSError as exc:
            archive_note = f"archive {args.archive} not written: {report.error_text(exc)}"

    elapsed = time.perf_counter() - started
    print(f"\nwrote {len(written)} files to {out_dir}/: {' '.join(p.name for p in written)}")
    stale = [n for n in earlier if n not in {p.name for p in written}]
    if stale:
        print(f"left from an earlier run (not written by this one): {' '.join(stale)}")
    if args.archive and not archive_note:
        print(f"archived them in {args.archive}")
    for note in (aborted, plot_note, archive_note):
        if note:
            print(note)
    for key, value in micro_summary.items():
        print(f"micro {key}: {value}")
    print(
        f"elapsed {elapsed:.0f} s on {env['gpu']} (EP={bench_group.world_size}, "
        f"torch {env['torch']})\n"
    )
    print(report.format_table(cases, ceilings.as_dicts()))
    if device.type == "cpu":
        print(f"\nnote: {INTERPRETER_NOTE}")
    if args.routing == "exact":
        print("\nrouting: exact (every expert gets T*K/E rows, so whole tiles and row steps); "
              "behind a real router the histogram is sampled and the grouped GEMMs run "
              "partial tiles: --routing sampled times that")
    # a case is one (provider, shape, T, mode, routing, imbalance), whatever its timings
    status: dict[tuple, str] = {}
    for c in cases:
        key = report.case_key(c)
        status[key] = c.status if status.get(key, "ok") == "ok" else status[key]
    ok = sum(v == "ok" for v in status.values())
    failed = sum(v == "failed" for v in status.values())
    if failed:
        print(f"\n{failed} of {len(status)} cases failed")
    if not ok:
        counts: dict[str, int] = {}
        for v in status.values():
            counts[v] = counts.get(v, 0) + 1
        detail = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no cases"
        print(f"no case succeeded ({detail}): exit status 1")
    return 1 if aborted or archive_note or not ok else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distmoe bench", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return quiet_on_closed_pipe(lambda: run(args))
    except ValueError as exc:
        parser.error(str(exc))
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
