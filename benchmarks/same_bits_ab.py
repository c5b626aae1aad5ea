"""Same bits, no slowdown: the working tree's distmoe against an older tree, in one process.

    git archive pre-restructure-57 src | tar -x -C /tmp/old
    python benchmarks/same_bits_ab.py --old /tmp/old/src --out out/same_bits

The old tree's ``distmoe`` package is copied to a temporary folder as ``distmoe_old`` (every
absolute import of ``distmoe`` rewritten; relative imports stay), so ``import distmoe`` (the
working tree's ``src/``, or ``--new``) and ``import distmoe_old`` live side by side. Both are
driven through the public API only: ``MoEConfig(hidden, ffn, num_experts, top_k, max_tokens,
precision="bf16", training=True)``, ``MoEContext(cfg, group)``, ``y = ctx(x, expert_ids,
scores, w13, w2)`` and ``torch.autograd.grad(y, (x, scores, w13, w2), grad_y)``, on one GPU,
EP = 1, both contexts on one one-rank gloo group (a FileStore in a temporary folder).

Per shape and routing:

1. Same bits: old and new run fwd+bwd on the same input tensors; y, dx, dscores, dw13 and
   dw2 are compared with ``torch.equal`` (and checked finite and not all zero). On a
   mismatch, old runs a second time: if old-vs-old is bit-exact the mismatch is a defect
   (``MISMATCH``), otherwise ``nondeterministic in both`` with the max abs differences of
   new-vs-old and old-vs-old side by side (not a pass).
2. No slowdown: eager fwd+bwd steps, then one fwd+bwd step of each version captured in a
   CUDA graph (warm-up on a side stream first), timed interleaved: ``--rounds`` rounds, each
   ``--iters`` steps of old and ``--iters`` of new, the first alternating between rounds, one
   pair of CUDA events per block. Reported: median ms per step of each, and the median
   (min, max) of the per-round ratios old/new (> 1: new is faster).

Both graphs share one memory pool (each capture frees every tensor it allocated, so no graph
output is alive across replays): DeepSeek-V3's weight gradients alone are 21 GiB per graph.

``--dry-run`` imports both packages, builds both configs per shape, prints the cases and exits
(no CUDA needed). ``--device cpu`` runs the bits comparison through Triton's interpreter (the
hidden ``tiny`` shape only, by default) and skips the timing.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import gc
import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OLD_NAME = "distmoe_old"

# name: (T, D, F, E, K)
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "dense-e32": (8192, 4096, 2048, 32, 8),
    "qwen3-30b-a3b-t2048": (2048, 2048, 768, 128, 8),
    "qwen3-30b-a3b": (4096, 2048, 768, 128, 8),
    "deepseek-v3": (4096, 7168, 2048, 256, 8),
    "gpt-oss-120b": (4096, 2880, 2880, 128, 4),
}
HIDDEN_SHAPES = {"tiny": (64, 64, 32, 8, 2)}
ALL_SHAPES = {**SHAPES, **HIDDEN_SHAPES}
ROUTINGS = ("sampled", "exact")
OUTPUTS = ("y", "dx", "dscores", "dw13", "dw2")


class SetupError(RuntimeError):
    """The old or new package could not be set up side by side."""


def log(msg: str) -> None:
    print(f"[same_bits {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ packages
_IMPORT_RULES = (
    # distmoe.x anywhere it is not part of a longer name (imports, attribute uses, strings)
    (re.compile(r"(?<![\w.])distmoe\.(?=\w)"), OLD_NAME + "."),
    (re.compile(r"\bimport(\s+)distmoe\b"), r"import\1" + OLD_NAME),
    (re.compile(r"\bfrom(\s+)distmoe(\s+)import\b"), r"from\1" + OLD_NAME + r"\2import"),
)
_LEFTOVER = re.compile(r"^\s*(from|import)\s+distmoe\b(?!_)", re.M)


def rewrite_source(text: str) -> tuple[str, int]:
    """``text`` with every absolute import of ``distmoe`` renamed to ``distmoe_old``;
    returns the new text and the number of replacements."""
    total = 0
    for pattern, repl in _IMPORT_RULES:
        text, n = pattern.subn(repl, text)
        total += n
    return text, total


def make_old_package(old_src: str | os.PathLike) -> tuple[Path, int]:
    """Copy ``old_src/distmoe`` to a new temporary folder as ``distmoe_old`` with its imports
    rewritten; returns the folder to put on ``sys.path`` (removed at exit) and the number of
    rewritten imports."""
    src = Path(old_src).resolve() / "distmoe"
    if not (src / "__init__.py").is_file():
        raise SetupError(f"--old {old_src}: no distmoe/__init__.py under it (pass the old "
                         "tree's src folder)")
    root = Path(tempfile.mkdtemp(prefix="same_bits_old-"))
    atexit.register(shutil.rmtree, root, True)
    dst = root / OLD_NAME
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    count, leftovers = 0, []
    for path in sorted(dst.rglob("*.py")):
        text, n = rewrite_source(path.read_text())
        count += n
        if n:
            path.write_text(text)
        leftovers += [f"{path.relative_to(root)}: {m.group(0).strip()}"
                      for m in _LEFTOVER.finditer(text)]
    if leftovers:
        raise SetupError("imports of distmoe left after the rewrite: " + "; ".join(leftovers))
    return root, count


@dataclass
class Packages:
    new: object  # the distmoe module
    old: object  # the distmoe_old module
    new_file: str
    old_file: str
    old_root: str
    rewritten_imports: int


_PACKAGES: Packages | None = None


def load_packages(old_src: str, new_src: str | None = None, retries: int = 0) -> Packages:
    """Import the working tree's ``distmoe`` (``new_src``, default ``<repo>/src``; an
    already-imported ``distmoe`` is used as it is) and the old tree as ``distmoe_old``
    (once per process). ``retries``: minutes to wait for a new tree that fails to import
    (mid-restructure)."""
    global _PACKAGES
    if _PACKAGES is not None:
        return _PACKAGES
    new_src = str(Path(new_src or REPO / "src").resolve())
    if "distmoe" not in sys.modules:
        sys.path.insert(0, new_src)
    for attempt in range(retries + 1):
        try:
            new = importlib.import_module("distmoe")
            break
        except Exception as exc:
            for name in [m for m in sys.modules if m == "distmoe" or m.startswith("distmoe.")]:
                del sys.modules[name]
            if attempt == retries:
                raise SetupError(f"import distmoe (new, {new_src}) failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
            log(f"import distmoe failed ({type(exc).__name__}: {exc}); retrying in 60 s")
            time.sleep(60)
    new_file = str(Path(new.__file__).resolve())
    if not new_file.startswith(new_src + os.sep):
        log(f"note: distmoe was already imported from {new_file}, not from {new_src}")
    root, count = make_old_package(old_src)
    sys.path.insert(0, str(root))
    before = {m for m in sys.modules if m == "distmoe" or m.startswith("distmoe.")}
    old = importlib.import_module(OLD_NAME)
    # the old package must not have pulled in (or replaced) any module of the new one
    after = {m for m in sys.modules if m == "distmoe" or m.startswith("distmoe.")}
    if after - before:
        raise SetupError(f"importing {OLD_NAME} imported new-tree modules: "
                         f"{sorted(after - before)[:5]}")
    stray = [m for m, mod in list(sys.modules.items())
             if (m == OLD_NAME or m.startswith(OLD_NAME + "."))
             and getattr(mod, "__file__", None)
             and not str(Path(mod.__file__).resolve()).startswith(str(root.resolve()))]
    if stray:
        raise SetupError(f"{OLD_NAME} modules outside {root}: {stray[:5]}")
    _PACKAGES = Packages(new=new, old=old, new_file=new_file,
                         old_file=str(Path(old.__file__).resolve()), old_root=str(root),
                         rewritten_imports=count)
    return _PACKAGES


def make_config(dm, shape: tuple[int, int, int, int, int]):
    T, D, F, E, K = shape
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        precision="bf16", training=True)


# ------------------------------------------------------------------------------ group
@contextlib.contextmanager
def single_rank_group(device):
    """A one-rank gloo world over a FileStore (or the existing default group if it has one
    rank); yields the group to pass to ``MoEContext`` (``None``: the default world)."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("same_bits_ab runs on a one-rank group; the default group has "
                               f"{dist.get_world_size()} ranks")
        yield None
        return
    tmp = tempfile.mkdtemp(prefix="same_bits_store-")
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield None
        finally:
            dist.destroy_process_group()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------ inputs
def case_seed(seed: int, shape_name: str, routing: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{shape_name}/{routing}".encode())) % 2**31


def exact_routing(T: int, E: int, K: int, g, device):
    """Every expert gets exactly T*K/E rows, K distinct experts per token: each group of E/K
    consecutive tokens takes one random permutation of the E experts, K per token (where
    K divides E and E/K divides T; otherwise token t's routes are (t*K + k) mod E under a
    random relabelling of the experts, rows shuffled)."""
    import torch

    if (T * K) % E:
        raise ValueError(f"exact routing needs E ({E}) to divide T*K ({T * K})")
    if E % K == 0 and T % (E // K) == 0:
        groups = T // (E // K)
        perms = torch.rand(groups, E, generator=g, device=device).argsort(dim=1)
        ids = perms.reshape(T, K)
    else:
        base = (torch.arange(T * K, device=device) % E).view(T, K)
        relabel = torch.rand(E, generator=g, device=device).argsort()
        rows = torch.rand(T, generator=g, device=device).argsort()
        ids = relabel[base][rows]
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert int(counts.min()) == int(counts.max()) == T * K // E, counts
    return ids.to(torch.int32)


def make_inputs(shape, routing: str, device, seed: int) -> dict:
    """x, ids, scores, w13, w2 and grad_y of one case from a seeded generator on ``device``
    (scores, w13 and w2 require grad; x is made a leaf at each call)."""
    import torch

    T, D, F, E, K = shape
    g = torch.Generator(device=device).manual_seed(seed)
    if routing == "exact":
        ids = exact_routing(T, E, K, g, device)
    elif routing == "sampled":
        ids = torch.rand(T, E, generator=g, device=device).topk(K, dim=1).indices
        ids = ids.to(torch.int32)
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    scores = torch.softmax(torch.rand(T, K, generator=g, device=device) + 0.1, dim=1)

    def draw(*size, scale=1.0):
        # in chunks over the first dimension: DeepSeek-V3's w13 is 7.5 G values (30 GB fp32)
        out = torch.empty(*size, dtype=torch.bfloat16, device=device)
        per = max(1, (1 << 27) // max(1, out[0].numel()))
        for i in range(0, size[0], per):
            n = min(per, size[0] - i)
            out[i:i + n] = (torch.randn(n, *size[1:], generator=g, device=device)
                            * scale).bfloat16()
        return out

    x = draw(T, D)
    w13 = draw(E, 2, F, D, scale=D ** -0.5)
    w2 = draw(E, D, F, scale=F ** -0.5)
    gy = draw(T, D)
    return dict(x=x, ids=ids, scores=scores.float().requires_grad_(True),
                w13=w13.requires_grad_(True), w2=w2.requires_grad_(True), gy=gy)


def fwd_bwd(ctx, inp: dict):
    """One training step through the public API: y and the gradients of x, scores, w13, w2."""
    import torch

    x = inp["x"].detach().requires_grad_(True)
    y = ctx(x, inp["ids"], inp["scores"], inp["w13"], inp["w2"])
    grads = torch.autograd.grad(y, (x, inp["scores"], inp["w13"], inp["w2"]), inp["gy"])
    return (y.detach(), *grads)


# ------------------------------------------------------------------------------ comparison
_CHUNK = 1 << 26  # elements per chunk when comparing tensors on different devices


def _chunks(a, b):
    fa, fb = a.reshape(-1), b.reshape(-1)
    for i in range(0, fa.numel(), _CHUNK):
        ca, cb = fa[i:i + _CHUNK], fb[i:i + _CHUNK]
        if ca.device != cb.device:
            cb = cb.to(ca.device)
        yield ca, cb


def tensors_equal(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device == b.device:
        return torch.equal(a, b)
    return all(torch.equal(ca, cb) for ca, cb in _chunks(a, b))


def max_abs_diff(a, b) -> float:
    m = 0.0
    for ca, cb in _chunks(a, b):
        d = (ca.float() - cb.float()).abs().nan_to_num(nan=float("inf"))
        m = max(m, float(d.max())) if d.numel() else m
    return m


def sanity(outs) -> dict:
    """Per output: all finite and not all zero."""
    import torch

    res = {}
    for name, t in zip(OUTPUTS, outs, strict=True):
        finite = all(bool(torch.isfinite(c).all()) for c, _ in _chunks(t, t))
        nonzero = any(bool(c.count_nonzero()) for c, _ in _chunks(t, t))
        res[name] = {"finite": finite, "nonzero": nonzero}
    return res


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _available_bytes(device) -> int:
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def compare_bits(ctx_old, ctx_new, inp: dict, device) -> dict:
    """Same bits of old and new on ``inp`` (see the module docstring); returns a dict with
    ``equal`` (per output), ``sanity``, ``max_abs_diff``, ``old_vs_old`` and ``verdict``:
    ``equal``, ``MISMATCH``, ``nondeterministic in both`` or ``BAD OUTPUT``."""
    import torch

    keep = {k: inp[k].detach().clone() for k in ("x", "ids", "scores", "gy")}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    old = fwd_bwd(ctx_old, inp)
    _sync(device)
    offloaded = False
    if cuda:
        kept = torch.cuda.memory_allocated(device)
        transient = torch.cuda.max_memory_allocated(device) - kept
        need = (kept - base) + transient + (2 << 30)
        if _available_bytes(device) < need:  # new's step would not fit beside old's outputs
            old = tuple(t.cpu() for t in old)
            offloaded = True
            gc.collect()
            torch.cuda.empty_cache()
    new = fwd_bwd(ctx_new, inp)
    _sync(device)
    res = {"offloaded_old_outputs": offloaded,
           "sanity": {"old": sanity(old), "new": sanity(new)}}
    res["equal"] = {n: tensors_equal(a, b) for n, a, b in zip(OUTPUTS, new, old, strict=True)}
    res["max_abs_diff"] = {n: (0.0 if res["equal"][n] else max_abs_diff(a, b))
                           for n, a, b in zip(OUTPUTS, new, old, strict=True)}
    del new
    res["inputs_unchanged"] = all(torch.equal(keep[k], inp[k].detach()) for k in keep)
    res["old_vs_old"] = None
    bad = [f"{v}.{n}" for v in ("old", "new") for n, s in res["sanity"][v].items()
           if not (s["finite"] and s["nonzero"])]
    if not all(res["equal"].values()):
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
        again = fwd_bwd(ctx_old, inp)
        _sync(device)
        eq = {n: tensors_equal(a, b) for n, a, b in zip(OUTPUTS, again, old, strict=True)}
        res["old_vs_old"] = {"equal": eq,
                             "max_abs_diff": {n: (0.0 if eq[n] else max_abs_diff(a, b))
                                              for n, a, b in zip(OUTPUTS, again, old, strict=True)}}
        del again
    del old
    if bad or not res["inputs_unchanged"]:
        res["verdict"] = "BAD OUTPUT"
        res["bad"] = bad + ([] if res["inputs_unchanged"] else ["inputs modified"])
    elif all(res["equal"].values()):
        res["verdict"] = "equal"
    elif all(res["old_vs_old"]["equal"].values()):
        res["verdict"] = "MISMATCH"
    else:
        res["verdict"] = "nondeterministic in both"
    return res


def passes(bits: dict) -> bool:
    """The rule of the brief: bit-equal, or old itself not deterministic."""
    return bits.get("verdict") in ("equal", "nondeterministic in both")


# ------------------------------------------------------------------------------ timing
def _interleaved(steps: dict, rounds: int, iters: int) -> dict:
    """``steps``: {"old": fn, "new": fn}. Per round, ``iters`` calls of each in a block timed
    by CUDA events, old first in even rounds; returns per-version ms per step for each round,
    their medians and the per-round old/new ratios."""
    import torch

    names = ["old", "new"]
    events = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                steps[n]()
            end.record()
            events[n].append((start, end))
        torch.cuda.synchronize()
    ms = {n: [s.elapsed_time(e) / iters for s, e in events[n]] for n in names}
    ratios = [o / w for o, w in zip(ms["old"], ms["new"], strict=True)]
    return {"ms": ms,
            "old_ms": statistics.median(ms["old"]), "new_ms": statistics.median(ms["new"]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds": rounds, "iters": iters}


def time_eager(ctx_old, ctx_new, inp, rounds: int, iters: int) -> dict:
    steps = {"old": lambda: fwd_bwd(ctx_old, inp), "new": lambda: fwd_bwd(ctx_new, inp)}
    for fn in steps.values():  # allocator and caches warm for both
        fn()
    return _interleaved(steps, rounds, iters)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _end_failed_capture() -> None:
    """After a capture that raised, the default CUDA generator can stay marked as capturing;
    a trivial capture that ends normally clears it (as distmoe's bench timing does)."""
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:
        pass
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.empty(1, device="cuda").zero_()
        del g
    except Exception:
        pass


def time_graphs(ctx_old, ctx_new, inp, rounds: int, iters: int) -> dict:
    """Capture one fwd+bwd step of each version (one shared pool), then interleaved replays.
    Returns the timing dict, or ``{"error": ...}`` naming the version whose capture failed."""
    import torch

    ctxs = {"old": ctx_old, "new": ctx_new}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for ctx in ctxs.values():
            for _ in range(2):
                fwd_bwd(ctx, inp)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph pool needs the room
    graphs, pool = {}, None
    for name, ctx in ctxs.items():
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                fwd_bwd(ctx, inp)  # outputs freed inside the capture: none outlive it
            g.replay()  # a validating replay: errors surface here, not mid-round
            torch.cuda.synchronize()
        except Exception as exc:
            _end_failed_capture()
            failed = f"graph capture of {name} failed: {_first_line(exc)}"
        else:
            failed = None
        if failed is not None:  # (after the except block: its traceback held the outputs)
            gc.collect()
            with contextlib.suppress(Exception):
                ctx.reset_slots()  # a forward captured without its backward
            graphs.clear()
            gc.collect()
            torch.cuda.empty_cache()
            return {"error": failed}
        graphs[name] = g
        pool = g.pool()
    try:
        return _interleaved({n: g.replay for n, g in graphs.items()}, rounds, iters)
    finally:
        graphs.clear()
        gc.collect()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ one case
def _timed(fn, *args) -> dict:
    """``fn(*args)`` with its wall time; an exception (an OOM, say) becomes ``{"error"}``
    so that the case's bits stay reported."""
    import torch

    t0 = time.monotonic()
    try:
        res = fn(*args)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        res = {"error": _first_line(exc)}
    if "error" in res:  # (after the except block: its traceback held the outputs)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        gc.collect()
        for ctx in args[:2]:  # a forward that ran without its backward keeps its slot
            with contextlib.suppress(Exception):
                ctx.reset_slots()
        gc.collect()
        torch.cuda.empty_cache()
    res["s"] = round(time.monotonic() - t0, 2)
    return res


def run_case(pk: Packages, shape_name: str, routing: str, device, group, *, seed: int = 0,
             rounds: int = 0, iters: int = 0, timing: bool = False, graph: bool = True,
             deadline: float | None = None) -> dict:
    """Build both contexts on the same inputs, compare bits, optionally time eager and CUDA
    graph steps, free everything; returns the case's results."""
    import torch

    shape = ALL_SHAPES[shape_name]
    t0 = time.monotonic()
    out = {"shape": shape_name, "routing": routing, "T_D_F_E_K": list(shape)}
    inp = make_inputs(shape, routing, device, case_seed(seed, shape_name, routing))
    ctx_old = ctx_new = None
    try:
        ctx_old = pk.old.MoEContext(make_config(pk.old, shape), group)
        ctx_new = pk.new.MoEContext(make_config(pk.new, shape), group)
        out["bits"] = compare_bits(ctx_old, ctx_new, inp, device)
        out["bits_s"] = round(time.monotonic() - t0, 2)
        if timing and device.type == "cuda":
            if deadline is not None and time.monotonic() > deadline:
                out["eager"] = out["graph"] = {"skipped": "budget exceeded"}
            else:
                out["eager"] = _timed(time_eager, ctx_old, ctx_new, inp, rounds, iters)
                if not graph:
                    out["graph"] = {"skipped": "--no-graph"}
                elif deadline is not None and time.monotonic() > deadline:
                    out["graph"] = {"skipped": "budget exceeded"}
                else:
                    out["graph"] = _timed(time_graphs, ctx_old, ctx_new, inp, rounds, iters)
    finally:
        for ctx in (ctx_new, ctx_old):
            if ctx is not None:
                with contextlib.suppress(Exception):
                    ctx.close()
        del ctx_old, ctx_new, inp
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    out["elapsed_s"] = round(time.monotonic() - t0, 2)
    return out


def run_same_bits(old_src: str, shape_name: str = "qwen3-30b-a3b-t2048",
                  routing: str = "sampled", device: str = "cuda", seed: int = 0,
                  new_src: str | None = None) -> dict:
    """The bits comparison of one case, group and packages included (for tests)."""
    import torch

    pk = load_packages(old_src, new_src)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    with single_rank_group(dev) as group:
        return run_case(pk, shape_name, routing, dev, group, seed=seed)


# ------------------------------------------------------------------------------ report
def _mark(b: bool | None) -> str:
    return "-" if b is None else ("=" if b else "X")


def _timing_cells(t: dict | None) -> list[str]:
    if not t or "ms" not in t:
        why = "" if not t else (t.get("error") or t.get("skipped") or "")
        return ["-", "-", "-", "-", why]
    return [f"{t['old_ms']:.3f}", f"{t['new_ms']:.3f}", f"{t['ratio']:.3f}",
            f"{t['ratio_min']:.3f}-{t['ratio_max']:.3f}", ""]


def format_table(cases: list[dict]) -> str:
    head = ["shape", "routing", "y dx ds w13 w2", "verdict",
            "graph old", "graph new", "old/new", "range",
            "eager old", "eager new", "old/new", "range", "note"]
    rows = [head]
    for c in cases:
        if "skipped" in c or "error" in c:
            rows.append([c["shape"], c["routing"], "", "SKIPPED" if "skipped" in c
                         else "ERROR", *["-"] * 8, c.get("skipped") or c.get("error")])
            continue
        b = c["bits"]
        marks = "  ".join(_mark(b["equal"][n]) for n in OUTPUTS)
        g, e = _timing_cells(c.get("graph")), _timing_cells(c.get("eager"))
        note = "; ".join(x for x in (g[4] and f"graph: {g[4]}", e[4] and f"eager: {e[4]}")
                         if x)
        if b["verdict"] != "equal":
            diffs = ", ".join(f"{n} {b['max_abs_diff'][n]:.3g}" for n in OUTPUTS
                              if not b["equal"][n])
            oo = b.get("old_vs_old")
            if oo:
                diffs += " | old-vs-old: " + (", ".join(
                    f"{n} {oo['max_abs_diff'][n]:.3g}" for n in OUTPUTS
                    if not oo["equal"][n]) or "bit-exact")
            if b.get("bad"):
                diffs += " | bad: " + ", ".join(b["bad"])
            note = f"max|new-old| {diffs}" + (f"; {note}" if note else "")
        rows.append([c["shape"], c["routing"], marks, b["verdict"], *g[:4], *e[:4], note])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = []
    for r in rows:
        cells = (v.ljust(w) for v, w in zip(r[:-1], widths, strict=True))
        lines.append("  ".join(cells) + "  " + r[-1])
    lines.insert(1, "-" * len(lines[0]))
    legend = ("bits: '=' torch.equal, 'X' differs; ms: median per fwd+bwd step; old/new: "
              "median of per-round ratios (> 1: new faster), range: min-max over rounds")
    return "\n".join(lines + [legend])


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except Exception:
        return None


def environment(device) -> dict:
    import torch
    import triton

    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([sys.executable, *sys.argv]),
           "host": platform.node(), "python": platform.python_version(),
           "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "git_head": _git("rev-parse", "HEAD")}
    status = _git("status", "--porcelain")
    env["git_dirty_paths"] = None if status is None else len(status.splitlines())
    return env


# ------------------------------------------------------------------------------ main
def _split(values: list[str] | None) -> list[str]:
    return [v for item in values or [] for v in item.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the old tree's src folder (holds distmoe/)")
    p.add_argument("--new", default=None, help="the new tree's src folder (default: this "
                   "repository's src/)")
    p.add_argument("--shapes", nargs="+", default=None,
                   help=f"names, comma or space separated (default: all of {list(SHAPES)}; "
                        "with --device cpu: tiny)")
    p.add_argument("--routing", default="sampled,exact", help="sampled,exact (default both)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    p.add_argument("--iters", type=int, default=10,
                   help="steps per version per round (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for same_bits.json (default: none)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="skip cases (and timing) that would start after this many seconds "
                        "(default 480; 0: no limit)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--no-timing", action="store_true", help="bits only")
    p.add_argument("--no-graph", action="store_true", help="eager timing only")
    p.add_argument("--dry-run", action="store_true",
                   help="import both packages, build both configs, print the cases, exit")
    p.add_argument("--import-retries", type=int, default=0,
                   help="minutes to retry a failing 'import distmoe' (new tree) (default 0)")
    args = p.parse_args(argv)
    args.shapes = _split(args.shapes)
    args.routing = _split([args.routing])
    for s in args.shapes:
        if s not in ALL_SHAPES:
            p.error(f"unknown shape {s!r}; known: {', '.join(ALL_SHAPES)}")
    for r in args.routing:
        if r not in ROUTINGS:
            p.error(f"unknown routing {r!r}; known: {', '.join(ROUTINGS)}")
    if not args.routing:
        p.error("--routing names no routing")
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s if args.budget_s > 0 else None
    try:
        pk = load_packages(args.old, args.new, retries=args.import_retries)
    except SetupError as exc:
        print(f"same_bits_ab: {exc}", file=sys.stderr)
        return 2
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        print("--device cuda: CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if not args.shapes:
        args.shapes = list(SHAPES) if device.type == "cuda" or args.dry_run else ["tiny"]
    cases = [(s, r) for s in args.shapes for r in args.routing]
    log(f"new: {pk.new_file}")
    log(f"old: {pk.old_file} ({pk.rewritten_imports} imports rewritten), "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}")

    if args.dry_run:
        for name in args.shapes:
            shape = ALL_SHAPES[name]
            cfgs = [make_config(dm, shape) for dm in (pk.old, pk.new)]
            plans = []
            for dm, cfg in zip((pk.old, pk.new), cfgs, strict=True):
                try:
                    plans.append(dm.plan_memory(cfg, 1).activation_buffer_bytes)
                except Exception as exc:
                    plans.append(f"plan_memory failed: {_first_line(exc)}")
            T, D, F, E, K = shape
            gib = (2 * (E * 3 * F * D) + 2 * T * D) * 2 / 2**30  # weights + grads, x + dx
            same = "same" if repr(cfgs[0]) == repr(cfgs[1]) else "DIFFER"
            print(f"{name:22s} T={T} D={D} F={F} E={E} K={K}  configs {same}  "
                  f"activation buffer old/new {plans[0]} / {plans[1]} B  "
                  f"weights+grads {gib:.1f} GiB")
        for s, r in cases:
            print(f"case {s} {r}")
        print(f"dry run: {len(cases)} cases, device {device}, rounds {args.rounds}, "
              f"iters {args.iters}, timing "
              f"{'off' if args.no_timing or device.type != 'cuda' else 'on'}")
        return 0

    env = environment(device)
    env.update(new_package=pk.new_file, old_package=pk.old_file, old_src=args.old,
               rewritten_imports=pk.rewritten_imports,
               triton_interpret=os.environ.get("TRITON_INTERPRET"))
    timing = not args.no_timing and device.type == "cuda"
    if not timing:
        log("timing off" + ("" if args.no_timing else " (needs CUDA)"))
    results = []
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)

    def dump():
        if out_dir:
            doc = {"environment": env, "args": vars(args), "cases": results,
                   "elapsed_s": round(time.monotonic() - t_start, 1)}
            (out_dir / "same_bits.json").write_text(json.dumps(doc, indent=1) + "\n")

    with single_rank_group(device) as group:
        for i, (shape_name, routing) in enumerate(cases):
            if deadline is not None and time.monotonic() > deadline:
                results.append({"shape": shape_name, "routing": routing,
                                "skipped": f"budget of {args.budget_s:.0f} s exceeded"})
                log(f"[{i + 1}/{len(cases)}] {shape_name} {routing}: skipped (budget)")
                continue
            log(f"[{i + 1}/{len(cases)}] {shape_name} {routing}: start "
                f"(elapsed {time.monotonic() - t_start:.0f} s)")
            t0 = time.monotonic()
            try:
                res = run_case(pk, shape_name, routing, device, group, seed=args.seed,
                               rounds=args.rounds, iters=args.iters, timing=timing,
                               graph=not args.no_graph, deadline=deadline)
            except Exception as exc:
                import traceback

                traceback.print_exc()
                res = {"shape": shape_name, "routing": routing, "error": _first_line(exc)}
            results.append(res)
            b = res.get("bits", {})
            msg = b.get("verdict", res.get("error", "?"))
            for kind in ("graph", "eager"):
                t = res.get(kind) or {}
                if "ratio" in t:
                    msg += (f"; {kind} old {t['old_ms']:.3f} new {t['new_ms']:.3f} ms "
                            f"old/new {t['ratio']:.3f}")
                elif t:
                    msg += f"; {kind}: {t.get('error') or t.get('skipped')}"
            log(f"[{i + 1}/{len(cases)}] {shape_name} {routing}: {msg} "
                f"({time.monotonic() - t0:.1f} s; elapsed {time.monotonic() - t_start:.0f} s)")
            dump()

    table = format_table(results)
    print(f"# same_bits_ab: {env.get('gpu') or device}, torch {env['torch']}, "
          f"triton {env['triton']}, {env['date_utc']}")
    print(table)
    dump()
    if out_dir:
        (out_dir / "same_bits.txt").write_text(table + "\n")
        log(f"wrote {out_dir / 'same_bits.json'}")
    ran = [c for c in results if "bits" in c]
    failed = [c for c in results if "error" in c or ("bits" in c and not passes(c["bits"]))]
    odd = [c for c in ran if c["bits"]["verdict"] == "nondeterministic in both"]
    log(f"{len(ran)} cases ran, {len(failed)} failed, {len(odd)} nondeterministic in both, "
        f"{len(results) - len(ran) - len([c for c in results if 'error' in c])} skipped; "
        f"{time.monotonic() - t_start:.0f} s")
    if failed:
        return 1  # a mismatch, bad output or an error
    return 3 if odd else 0  # 3: old itself is not deterministic somewhere (not a pass)


if __name__ == "__main__":
    sys.exit(main())
