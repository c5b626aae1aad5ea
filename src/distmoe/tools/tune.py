"""``python -m distmoe tune KERNEL``: time one kernel over its launch configs.

For each named bench shape (EP=1; ``--routing random``: T*K rows spread over the E experts at
random, so most experts end in a partial row step, or ``balanced``: T*K/E rows each, as the
bench's exact routing gives) the kernel is run with

* the config the kernel plan picks for that layer on this device
  (:func:`distmoe.plan.plan_kernels`, ``--device-class`` to plan for another): the baseline
  row, marked ``PLAN``;
* every candidate of its config class's ``all_configs()`` list (the Triton kernel), and on a
  Hopper device class the warp-specialised Gluon kernel's configs; ``--max-candidates N``
  keeps the first N.

Each candidate runs once on fresh outputs (poisoned first) and its output is compared with the
baseline's (``err``: the largest difference over the largest magnitude; the same rows in the
same order, so expect 0 or rounding-level differences; a config that fails to build or run is
listed with its error). Then all of them and a reference (``torch._grouped_mm`` of the same
GEMM on pre-gathered rows, for the GEMMs; a device copy of the rows' size, for the combine)
are timed against each other (:func:`distmoe.tools.bench.timing.interleaved`: ``--iters``
launches captured in one CUDA graph per candidate, one replay of each per round in rotating
order, ``--rounds`` rounds), so that the GPU's clock drift does not decide between configs
timed minutes apart. Printed per shape: the fastest ``--show`` candidates and the plan's, with
ms, TFLOP/s (GB/s for the combine), the ratio to the plan's (> 1: faster) and to the
reference. ``--csv`` writes every row.

Kernels: ``w13`` (gather + W13 + SwiGLU, inference outputs), ``w13_train`` (h1 and the
gathered rows stored too, a training forward), ``w13_h1`` (h1 stored, not the rows), ``w2``
(W2 + scatter), ``w2_dgrad`` (W2 DGRAD + SwiGLU backward), ``w2_dgrad_scored`` (the same
reading each route's score from its row, as the layer's training path), ``w13_dgrad``
(W13 DGRAD + scatter), ``w2_wgrad``, ``w13_wgrad`` (x's rows stored in order at a device
offset, as autograd passes them), ``w13_wgrad_x_rows`` (x's rows read in place through the
gather table, a layer that kept its input), ``combine`` (the owner combine).

On a machine without a GPU the kernels run in Triton's interpreter (the ``smoke`` shape, a
few candidates): a smoke run of the tool, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: the kernels ``tune`` times
KERNELS = ("w13", "w13_train", "w13_h1", "w2", "w2_dgrad", "w2_dgrad_scored", "w13_dgrad",
           "w2_wgrad", "w13_wgrad", "w13_wgrad_x_rows", "combine")
#: the kernel-plan entry whose config each kernel runs
PLAN_KEY = {"w13": "w13", "w13_train": "w13", "w13_h1": "w13", "w2": "w2",
            "w2_dgrad": "w2_dgrad", "w2_dgrad_scored": "w2_dgrad", "w13_dgrad": "w13_dgrad",
            "w2_wgrad": "w2_wgrad", "w13_wgrad": "w13_wgrad", "w13_wgrad_x_rows": "w13_wgrad",
            "combine": "combine"}
DEFAULT_SHAPES = ("dense-e32", "qwen3-30b-a3b")


@dataclass
class Case:
    """One kernel at one shape: ``run(cfg)`` launches it, ``out`` is what it writes (poisoned
    with ``poison`` before a checked run), ``reference`` the comparison point (None where it
    cannot run here), ``work`` the FLOPs (or bytes, ``unit`` "GB/s") of one launch, ``keep``
    the tensors it reads by address."""

    run: Callable[[object], None]
    out: torch.Tensor
    poison: float
    reference: Callable[[], object] | None
    reference_name: str
    work: float
    unit: str = "TFLOP/s"
    #: tensors the launch reads through pointer tables only (kept alive here)
    keep: tuple = ()


# --------------------------------------------------------------------------- candidate lists
def gluon_candidates(kernel: str, hidden: int, ffn: int) -> list:
    """The warp-specialised Gluon kernel's configs a sweep times for ``kernel`` (Hopper)."""
    from distmoe.kernels.w2_dgrad.config import W2DgradConfig
    from distmoe.kernels.w2_forward.config import W2Config
    from distmoe.kernels.w13_dgrad.config import W13DgradConfig
    from distmoe.kernels.w13_forward.config import W13Config
    from distmoe.kernels.wgrad.config import WgradConfig
    from distmoe.kernels.wgrad.gluon import GLUON_WGRAD_CONFIGS

    family = PLAN_KEY[kernel]
    if family == "w13":  # ping-pong 128 x 64 / 64 x 128 tiles (4 warps), cooperative (8)
        return [W13Config(block_m=128, block_n=bn, block_k=64, num_warps=nw, num_stages=st,
                          group_m=gm, persistent=True, gluon=True)
                for bn, st, gm, nw in ((64, 4, 8, 4), (64, 5, 8, 4), (64, 6, 8, 4),
                                       (128, 3, 8, 4), (128, 4, 8, 4), (128, 5, 8, 4),
                                       (128, 4, 16, 4), (128, 3, 8, 8), (128, 4, 8, 8),
                                       (128, 4, 16, 8))]
    if family == "w2":  # ping-pong 128 x 128 (4 warps), cooperative 128 x 256 (8)
        return [W2Config(block_m=128, block_n=bn, block_k=64, num_warps=nw, num_stages=st,
                         group_m=gm, persistent=True, gluon=True)
                for bn, nw, st, gm in ((128, 4, 4, 8), (128, 4, 5, 8), (128, 4, 6, 8),
                                       (128, 4, 5, 16), (256, 8, 3, 8), (256, 8, 4, 8),
                                       (256, 8, 4, 16))]
    if family == "w2_dgrad":  # its own grid; and its split form (epilogue in 8 warps)
        return ([W2DgradConfig(block_m=128, block_n=128, block_k=64, num_stages=st, gluon=True)
                 for st in (4, 5, 6)]
                + [W2DgradConfig(block_m=128, block_n=128, block_k=64, num_stages=st,
                                 gluon=True, epilogue_warps=8) for st in (3, 4, 5)])
    if family == "w13_dgrad":  # the Gluon W2 forward kernel with N-major weight tiles
        return [W13DgradConfig(block_m=128, block_n=bn, block_k=64, num_warps=nw,
                               num_stages=st, persistent=True, gluon=True)
                for bn, nw, st in ((128, 4, 4), (128, 4, 5), (128, 4, 6), (256, 8, 3),
                                   (256, 8, 4))]
    if family.endswith("wgrad"):  # the persistent kernel, warp-specialised, ping-pong
        out_rows, out_cols = (hidden, ffn) if family == "w2_wgrad" else (2 * ffn, hidden)
        out = []
        for bp, bq, stages, warps, bk in GLUON_WGRAD_CONFIGS:
            for ws, pp in ((False, False), (True, False), (True, True)):
                if ws and min(bq, out_cols) > 128 or pp and (warps != 4 or bp != 128):
                    continue
                if out_rows % bp == 0:
                    out.append(WgradConfig(block_m=128, block_k=bk, block_out_m=bp,
                                           block_out_n=min(bq, out_cols), num_warps=warps,
                                           num_stages=stages, gluon=True, specialized=ws,
                                           pingpong=pp))
        return out
    return []


def triton_candidates(kernel: str, hidden: int, ffn: int) -> list:
    """The config class's ``all_configs()`` list for ``kernel``."""
    from distmoe.kernels.movement.combine import CombineConfig
    from distmoe.kernels.w2_dgrad.config import W2DgradConfig
    from distmoe.kernels.w2_forward.config import W2Config
    from distmoe.kernels.w13_dgrad.config import W13DgradConfig
    from distmoe.kernels.w13_forward.config import W13Config
    from distmoe.kernels.wgrad.config import WgradConfig

    family = PLAN_KEY[kernel]
    if family == "w13":
        return W13Config.all_configs()
    if family == "w2":
        return W2Config.all_configs()
    if family == "w2_dgrad":
        return W2DgradConfig.all_configs(hidden=hidden, ffn=ffn)
    if family == "w13_dgrad":
        return W13DgradConfig.all_configs(hidden=hidden, ffn=ffn)
    if family == "w2_wgrad":
        return WgradConfig.all_configs(out_rows=hidden, out_cols=ffn)
    if family == "w13_wgrad":
        return WgradConfig.all_configs(out_rows=2 * ffn, out_cols=hidden)
    return CombineConfig.all_configs()


def plan_config(kernel: str, shape, device_class: str):
    """The config the kernel plan picks for ``kernel`` at ``shape`` (EP=1, T = the shape's)
    on ``device_class``: the baseline row."""
    import distmoe as dm
    from distmoe.plan import plan_kernels

    training = kernel not in ("w13", "w2", "combine")
    extra = {}
    if kernel == "w13_wgrad_x_rows":  # a layer that kept its input, its rows read in place
        extra = dict(save_gathered_rows=False, gathered_rows_in_place=True)
    cfg = dm.MoEConfig(hidden=shape.hidden, ffn=shape.ffn, num_experts=shape.num_experts,
                       top_k=shape.top_k, max_tokens=shape.tokens, training=training, **extra)
    return getattr(plan_kernels(cfg, ep_size=1, device_class=device_class), PLAN_KEY[kernel])


def candidates(kernel: str, shape, device_class: str, max_candidates: int = 0) -> list:
    """The plan's config first, then the Gluon configs (Hopper classes) and the Triton list,
    without repeats and (Hopper) without those that do not fit an SM90; at most
    ``max_candidates`` besides the plan's (0: all)."""
    hopper = device_class in ("h100", "h200")
    base = plan_config(kernel, shape, device_class)
    rest = (gluon_candidates(kernel, shape.hidden, shape.ffn) if hopper else []) + \
        triton_candidates(kernel, shape.hidden, shape.ffn)
    out = [base]
    for cfg in rest:
        if cfg in out or (hopper and hasattr(cfg, "fits_hopper") and not cfg.fits_hopper()):
            continue
        out.append(cfg)
    return out[:1 + max_candidates] if max_candidates else out


def describe(cfg) -> str:
    """A config in a few words: its fields that differ from the class defaults."""
    fields = dataclasses.fields(cfg)
    parts = []
    for f in fields:
        value = getattr(cfg, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            parts.append(f"{f.name}={value}")
    return " ".join(parts)


# ------------------------------------------------------------------------------- the cases
def _layout(T: int, K: int, E: int, dev, routing: str, gen: torch.Generator):
    """Rows per expert, the row and padded offsets, the row capacity and each row's token."""
    R = T * K
    if routing == "random":
        counts = torch.bincount(torch.randint(0, E, (R,), generator=gen), minlength=E)
    else:
        counts = torch.full((E,), R // E, dtype=torch.int64)
        counts[: R % E] += 1
    ro = torch.zeros(E + 1, dtype=torch.int32)
    ro[1:] = counts.cumsum(0)
    po = torch.zeros(E + 1, dtype=torch.int32)
    po[1:] = ((counts + 127) // 128 * 128).cumsum(0)
    r_cap = int(po[-1]) + 128 * 4  # some idle tiles, as the receive bound leaves
    token = torch.randint(0, T, (R,), generator=gen)
    return counts, ro.to(dev), po.to(dev), r_cap, token


def _grouped(a, b, offs):
    return lambda: torch._grouped_mm(a, b, offs=offs)


def make_case(kernel: str, shape, dev, routing: str = "random", seed: int = 0) -> Case:
    """The tensors and launch of ``kernel`` at ``shape`` on ``dev`` (see the module
    docstring)."""
    gen = torch.Generator().manual_seed(seed)
    T, D, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    R = T * K

    def randn(*dims, scale=1.0):
        return (torch.randn(*dims, generator=gen) * scale).to(dev, torch.bfloat16)

    if kernel == "combine":
        from distmoe.kernels.movement.combine import combine

        rows = randn(R, D)
        ids = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32).to(dev)
        scores = torch.rand(T, K, generator=gen).to(dev)
        y = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(rows)
        return Case(run=lambda c: combine(rows, ids, scores, y, config=c), out=y,
                    poison=float("nan"), reference=lambda: dst.copy_(rows),
                    reference_name="copy", work=(R * D + T * D) * 2, unit="GB/s")
    counts, ro, po, r_cap, token = _layout(T, K, E, dev, routing, gen)
    offs = ro[1:].contiguous()
    if kernel.endswith("wgrad") or kernel == "w13_wgrad_x_rows":
        return _wgrad_case(kernel, shape, dev, ro, po, token, randn, gen)
    x = randn(T, D)
    w13 = randn(E, 2, F, D, scale=D**-0.5)
    w2 = randn(E, D, F, scale=F**-0.5)
    # padded-row pointer tables: live rows first in each segment
    gather = torch.zeros(r_cap, dtype=torch.int64)
    scatter = torch.zeros(r_cap, dtype=torch.int64)
    combine_rows = torch.zeros(R, D, device=dev, dtype=torch.bfloat16)
    pos = 0
    starts = po.tolist()
    for e in range(E):
        n = int(counts[e])
        rows = torch.arange(starts[e], starts[e] + n)
        gather[rows] = x.data_ptr() + token[pos:pos + n] * D * 2
        scatter[rows] = combine_rows.data_ptr() + torch.arange(pos, pos + n) * D * 2
        pos += n
    gather, scatter = gather.to(dev), scatter.to(dev)
    h2 = torch.zeros(R, F, device=dev, dtype=torch.bfloat16)
    w13_flops, w2_flops = 2 * R * 2 * F * D, 2 * R * D * F
    if kernel.startswith("w13") and "dgrad" not in kernel:
        from distmoe.kernels.w13_forward.triton import gather_w13_swiglu

        x_g = x[token.to(dev)].contiguous()
        ref = _grouped(x_g, w13.view(E, 2 * F, D).transpose(-2, -1), offs)
        h1 = torch.empty(R, 2 * F, device=dev, dtype=torch.bfloat16)
        xo = torch.empty(R, D, device=dev, dtype=torch.bfloat16)
        outputs = {"w13": {}, "w13_train": dict(h1_out=h1, x_out=xo),
                   "w13_h1": dict(h1_out=h1)}[kernel]
        return Case(run=lambda c: gather_w13_swiglu(gather, po, ro, w13, h2, config=c,
                                                    **outputs),
                    out=h2, poison=0.0, reference=ref, reference_name="torch._grouped_mm",
                    work=w13_flops, keep=(x,))
    if kernel == "w2":
        from distmoe.kernels.w2_forward.triton import w2_scatter

        h2.copy_(randn(R, F))
        ref = _grouped(randn(R, F), w2.transpose(-2, -1), offs)
        return Case(run=lambda c: w2_scatter(h2, po, ro, w2, scatter, config=c),
                    out=combine_rows, poison=0.0, reference=ref,
                    reference_name="torch._grouped_mm", work=w2_flops)
    h1 = randn(R, 2 * F)
    grad_h1 = torch.zeros(R, 2 * F, device=dev, dtype=torch.bfloat16)
    if kernel in ("w2_dgrad", "w2_dgrad_scored"):
        from distmoe.kernels.w2_dgrad.triton import w2_dgrad_swiglu_bwd

        combine_rows.copy_(randn(R, D))
        scored = kernel == "w2_dgrad_scored"
        if scored:  # each route's score at the start of its row, as the layer's training path
            combine_rows.view(torch.float32)[:, 0] = torch.rand(R, generator=gen).to(dev)
        gh3_rows = randn(R, D)  # already in activation rows (pushed by their owners)
        ref = _grouped(gh3_rows, w2, offs)

        def run(c):
            # the layer's path: the rows already in place (pushed by their owners)
            w2_dgrad_swiglu_bwd(scatter, po, ro, w2, h1, grad_h1, h2_out=h2,
                                grad_h3_rows=gh3_rows, scored_rows=scored, config=c)
        return Case(run=run, out=grad_h1, poison=0.0, reference=ref,
                    reference_name="torch._grouped_mm", work=w2_flops, keep=(combine_rows,))
    if kernel == "w13_dgrad":
        from distmoe.kernels.w13_dgrad.triton import w13_dgrad_scatter

        grad_h1.copy_(randn(R, 2 * F))
        ref = _grouped(randn(R, 2 * F), w13.view(E, 2 * F, D), offs)
        return Case(run=lambda c: w13_dgrad_scatter(grad_h1, po, ro, w13, scatter, config=c),
                    out=combine_rows, poison=0.0, reference=ref,
                    reference_name="torch._grouped_mm", work=w13_flops)
    raise ValueError(f"kernel ({kernel!r}) must be one of {KERNELS}")


def _wgrad_case(kernel, shape, dev, ro, po, token, randn, gen) -> Case:
    from distmoe.kernels.wgrad.triton import w2_wgrad, w13_wgrad

    T, D, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    R = T * K
    offs = ro[1:].contiguous()
    if kernel == "w2_wgrad":
        gh3, h2 = randn(R, D), randn(R, F)
        g2 = torch.empty(E, D, F, device=dev, dtype=torch.bfloat16)
        return Case(run=lambda c: w2_wgrad(gh3, h2, po, ro, g2, accumulate=False, config=c),
                    out=g2, poison=float("nan"),
                    reference=lambda: torch._grouped_mm(gh3.t(), h2, offs=offs),
                    reference_name="torch._grouped_mm", work=2 * R * D * F)
    gh1 = randn(R, 2 * F)
    g13 = torch.empty(E, 2, F, D, device=dev, dtype=torch.bfloat16)
    pad = torch.zeros(64, device=dev, dtype=torch.bfloat16)
    if kernel == "w13_wgrad":
        # x's rows as the layer passes them: a 1-D base and a device-side offset (the
        # activation slot's cursor), so its descriptor is built on the device
        x = randn(R, D)
        x_base = torch.cat([pad, x.reshape(-1)])
        x_offset = torch.tensor([64], dtype=torch.int64, device=dev)

        def run(c):
            w13_wgrad(gh1, x_base, po, ro, g13, x_offset=x_offset, accumulate=False, config=c)
    else:
        # x's rows read in place (a layer that kept x): token-major x [T, D] at a device-side
        # offset and the gather table by padded row, each route on its own row
        x_tok = randn(T, D)
        x = x_tok[token.to(dev)]
        tok_base = torch.cat([pad, x_tok.reshape(-1)])
        act = torch.arange(R, device=dev)
        expert = torch.searchsorted(ro[1:].long(), act, right=True)
        table = torch.zeros(int(po[-1]), dtype=torch.int64, device=dev)
        origin = x_tok.data_ptr()  # the table names x_tok's rows; read at tok_base + 64
        table[po.long()[expert] + act - ro.long()[expert]] = origin + token.to(dev) * (D * 2)
        xo_rows = torch.tensor([64, 0], dtype=torch.int64, device=dev)

        def run(c):
            w13_wgrad(gh1, tok_base, po, ro, g13, x_offset=xo_rows, accumulate=False,
                      config=c, x_rows=table, rows_origin=origin)
    return Case(run=run, out=g13, poison=float("nan"),
                reference=lambda: torch._grouped_mm(gh1.t(), x, offs=offs),
                reference_name="torch._grouped_mm", work=2 * R * 2 * F * D, keep=(x,))


# ------------------------------------------------------------------------------ the sweep
def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| over the largest |ref|, in fp32 a sixteenth of the leading
    dimension at a time (a whole fp32 copy of DeepSeek-V3's W13 gradients is 28 GiB); NaN
    where got holds one."""
    pairs = list(zip(got.chunk(16), ref.chunk(16), strict=True))
    diff = torch.stack([(g.float() - r.float()).abs().max() for g, r in pairs])
    mag = torch.stack([r.float().abs().max() for _, r in pairs])
    return (diff.max() / mag.max().clamp_min(1e-30)).item()


def sweep(kernel: str, shape, dev, *, device_class: str, routing: str = "random",
          max_candidates: int = 0, rounds: int = 7, iters: int = 10,
          log=print) -> list[dict]:
    """Check and time every candidate of ``kernel`` at ``shape`` (module docstring); one row
    per candidate (and the reference), the plan's first."""
    from .bench.timing import interleaved

    case = make_case(kernel, shape, dev, routing)
    cands = candidates(kernel, shape, device_class, max_candidates)
    rows: list[dict] = []
    want = None
    fns: dict[str, Callable[[], object]] = {}
    for i, cfg in enumerate(cands):
        row = dict(shape=shape.name, kernel=kernel, routing=routing, plan=i == 0,
                   config=describe(cfg), status="ok", error="", err=None, ms=None)
        try:
            case.out.fill_(case.poison)
            case.run(cfg)
            if want is None:
                want = case.out.clone()  # the plan's result
            row["err"] = _rel_err(case.out, want)
        except Exception as exc:  # a config that does not build or run is a result
            row.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:160]}")
            log(f"  {'PLAN ' if i == 0 else ''}{row['config']}: {row['error']}")
        else:
            fns[f"c{i}"] = (lambda cfg=cfg: case.run(cfg))
        rows.append(row)
    if case.reference is not None:
        try:
            case.reference()
            fns["reference"] = case.reference
        except Exception as exc:  # torch._grouped_mm where this torch has no kernel for it
            log(f"  reference {case.reference_name} not run here: {type(exc).__name__}: "
                f"{str(exc)[:100]}")
    if fns:
        stats = interleaved(fns, rounds=rounds, iters=iters, device=dev)
        for i, row in enumerate(rows):
            st = stats.get(f"c{i}")
            if st is not None:
                row.update(ms=st.iter_ms, min_ms=st.min_ms, max_ms=st.max_ms)
        if "reference" in stats:
            st = stats["reference"]
            rows.append(dict(shape=shape.name, kernel=kernel, routing=routing, plan=False,
                             config=case.reference_name, status="reference", error="",
                             err=None, ms=st.iter_ms, min_ms=st.min_ms, max_ms=st.max_ms))
    plan_ms = rows[0]["ms"]
    ref_ms = next((r["ms"] for r in rows if r["status"] == "reference"), None)
    scale = 1e9 if case.unit == "TFLOP/s" else 1e6
    for r in rows:
        ms = r["ms"]
        r["rate"] = case.work / ms / scale if ms else None
        r["unit"] = case.unit
        r["vs_plan"] = plan_ms / ms if ms and plan_ms else None
        r["vs_reference"] = ref_ms / ms if ms and ref_ms else None
    return rows


def format_rows(rows: list[dict], show: int) -> list[str]:
    """The fastest ``show`` timed rows, the plan's and the reference, fastest first."""
    timed = sorted((r for r in rows if r["ms"] is not None), key=lambda r: r["ms"])
    keep = [r for i, r in enumerate(timed) if i < show or r["plan"] or r["status"] ==
            "reference"]
    unit = rows[0]["unit"]
    lines = [f"  {'ms':>9} {'(fastest-slowest round)':>23} {unit:>8} {'vs plan':>8} "
             f"{'vs ref':>7} {'err':>8}  config"]
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in keep:
        tag = "PLAN " if r["plan"] else ("REFERENCE " if r["status"] == "reference" else "")
        spread = f"({r['min_ms']:.4f}-{r['max_ms']:.4f})"
        lines.append(f"  {r['ms']:9.4f} {spread:>23} "
                     f"{num(r['rate'], '.1f'):>8} {num(r['vs_plan'], '.3f'):>8} "
                     f"{num(r['vs_reference'], '.3f'):>7} {num(r['err'], '.1e'):>8}  "
                     f"{tag}{r['config']}")
    return lines


# ------------------------------------------------------------------------------ command line
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``tune`` options."""
    from .bench.workloads import SHAPES

    p.description = ("Time one kernel over its launch configs (the plan's pick as the "
                     "baseline, the config class's candidates, the Gluon configs on Hopper), "
                     "interleaved round by round, each output checked against the plan's.")
    p.epilog = ("Kernels: " + ", ".join(KERNELS) + ". Without a GPU the kernels run in "
                "Triton's interpreter: a smoke run (--shapes smoke --max-candidates 2).")
    p.add_argument("kernel", choices=KERNELS, metavar="KERNEL",
                   help=f"the kernel to tune: {', '.join(KERNELS)}")
    p.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES), metavar="NAME",
                   help=f"bench shapes (default: {' '.join(DEFAULT_SHAPES)}; without a GPU: "
                        f"smoke); one of {', '.join(sorted(SHAPES))}")
    p.add_argument("--routing", choices=["random", "balanced"], default="random",
                   help="random: T*K rows spread over the experts at random (partial last "
                        "row steps); balanced: T*K/E rows each (default: random)")
    p.add_argument("--device-class", choices=["h100", "h200", "generic"], default=None,
                   help="plan the baseline and pick candidates for this device class "
                        "(default: this device's)")
    p.add_argument("--max-candidates", type=int, default=0, metavar="N",
                   help="time at most N candidates besides the plan's (default: all)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: 7)")
    p.add_argument("--iters", type=int, default=10,
                   help="launches per CUDA graph and round (default: 10)")
    p.add_argument("--show", type=int, default=6,
                   help="fastest candidates printed per shape (default: 6)")
    p.add_argument("--csv", default=None, metavar="FILE", help="also write every row here")
    return p


def run(args) -> int:
    """Run the command; returns the exit status (2 for a usage error)."""
    from distmoe.plan import device_class as class_of

    from . import INTERPRETER_NOTE
    from .bench.report import write_csv
    from .bench.workloads import SHAPES

    for name in ("rounds", "iters", "show"):
        if getattr(args, name) < 1:
            print(f"distmoe tune: error: --{name} ({getattr(args, name)}) must be >= 1",
                  file=sys.stderr)
            return 2
    if args.max_candidates < 0:
        print(f"distmoe tune: error: --max-candidates ({args.max_candidates}) must be >= 0",
              file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shapes = args.shapes or (DEFAULT_SHAPES if cuda else ("smoke",))
    dc = args.device_class or class_of(dev)
    where = torch.cuda.get_device_name(dev) if cuda else "CPU (Triton interpreter)"
    out_rows = []
    for name in shapes:
        s = SHAPES[name]
        print(f"\n{name} {args.kernel}: T={s.tokens} D={s.hidden} F={s.ffn} E={s.num_experts} "
              f"K={s.top_k}, {args.routing} routing, {where}, plan for device class {dc}",
              flush=True)
        rows = sweep(args.kernel, s, dev, device_class=dc, routing=args.routing,
                     max_candidates=args.max_candidates, rounds=args.rounds, iters=args.iters)
        failed = sum(r["status"] == "failed" for r in rows)
        print(f"  {sum(r['status'] == 'ok' for r in rows)} configs timed"
              f"{f', {failed} failed' if failed else ''}; {args.rounds} rounds of "
              f"{args.iters} launches{' from a CUDA graph' if cuda else ''} (median, "
              "fastest-slowest round); vs plan / vs ref: their time over this one (> 1: "
              "faster)")
        print("\n".join(format_rows(rows, args.show)), flush=True)
        out_rows += rows
        if cuda:
            torch.cuda.empty_cache()
    if not cuda:
        print(f"\nnote: {INTERPRETER_NOTE}")
    if args.csv and out_rows:
        write_csv(args.csv, out_rows, list(dict.fromkeys(k for r in out_rows for k in r)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m distmoe.tools.tune``)."""
    from . import quiet_on_closed_pipe

    parser = add_arguments(argparse.ArgumentParser(prog="distmoe tune"))
    args = parser.parse_args(argv)
    return quiet_on_closed_pipe(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
