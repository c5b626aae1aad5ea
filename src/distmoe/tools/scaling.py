"""``python -m distmoe scaling``: the expected time of one layer call at EP = 8 to 256 (past
one NVLink node), from EP=1 times measured by the bench and the links' bandwidths.

Usage::

    python -m distmoe scaling --results docs/perf/.../results.json [...] \\
        [--ep 8 16 64 256] [--gpus-per-node 8] [--nvlink-gbps 450] [--nic-gbps 50] \\
        [--nic-efficiency 0.8] [--hbm-gbps 3350] [--ep2 SHAPE:MODE:RATIO ...] [--json FILE]

The model, per suite shape (T tokens per rank, D, F, E experts, K routes per token) and mode,
for ``EP`` ranks in ``N = EP / n`` nodes of ``n = min(EP, gpus_per_node)`` GPUs (weak
scaling: every rank keeps T tokens; E must divide by EP), in milliseconds:

* ``compute``: the EP=1 time of the same shape from ``--results`` (distmoe's CUDA-graph
  figure; sampled routing where the file has it). A rank executes about T*K routes at any
  EP, over E/EP experts with more rows each, so this is an upper bound of its expert work.
* ``intra``: the peer transport inside a node. Per rank ``n-1`` of every ``n`` routes cross
  NVLink twice (dispatch rows in bf16, results back in bf16): ``2 T K D 2 (n-1)/n`` bytes at
  ``--nvlink-gbps``. The layer reads and writes those rows inside its GEMMs, so only a part
  of that time shows: ``exposed``, fitted from measured EP=2 / EP=1 time ratios (``--ep2``:
  ``(ratio - 1) * ep1_ms`` over the EP=2 byte time, ``ep1_ms`` the EP=1 time the ratio was
  measured against, or the ``--results`` one), 1 (nothing hidden) without them.
* ``collective``: the ``"hierarchical"`` transport as built (:mod:`distmoe.ops.transport`;
  ``"nccl"`` is its n = 1 case), between nodes. Forward: an all-gather of the N ranks'
  tokens (``(N-1) T (2 D + 8 K)`` bytes received per rank: x in bf16, ids and scores) and a
  reduce-scatter of the fp32 partial sums (``(N-1) T 4 D``), at ``--nic-gbps`` times
  ``--nic-efficiency`` per GPU; the backward moves the same again (the adjoint collectives).
* ``hbm``: the token-side passes of the inner layer over ``N T`` rows (the gathered x written
  and read, y_part written in bf16, widened to fp32, reduced): ``N T D 12`` bytes per
  forward, twice with the backward, at ``--hbm-gbps``.
* ``total``: ``compute + intra + collective + hbm`` (the collectives run before and after the
  experts: nothing overlaps them); ``overlapped``: the bound if they did, ``max(compute +
  intra, collective) + hbm``.
* ``all_to_all``: for comparison, the NIC time of an all-to-all dispatch and combine (not
  built): only the routes to other nodes cross, ``2 T K D 2 (EP-n)/EP`` bytes per forward
  (twice with the backward). The all-gather sends a token once per node, the all-to-all once
  per route: about ``6 T D (N-1)`` bytes (bf16 x in, fp32 sums out) against ``4 T K D
  (N-1)/N``, so the all-gather moves less below about ``N = 2K/3`` nodes and more past it.

What it leaves out: router skew (the slowest rank sets the time), NCCL's latency per
collective (tens of microseconds), congestion between nodes, and the EP=1 time's own
variation. docs/scaling.md holds the tables and the EP=2 check.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .bench import report
from .bench.workloads import MoEShape, get_shape

#: NIC bytes per GPU of an all-gather row: x (bf16) per D, then ids (int32) and scores (fp32)
_ID_SCORE_BYTES = 8


@dataclass(frozen=True)
class Links:
    """The bandwidths the model uses, GB/s per GPU and direction (``nic_efficiency``: the
    share of ``nic_gbps`` a collective achieves)."""

    nvlink_gbps: float = 450.0
    nic_gbps: float = 50.0
    nic_efficiency: float = 0.8
    hbm_gbps: float = 3350.0
    gpus_per_node: int = 8


@dataclass
class Estimate:
    """One row of the model (milliseconds; module docstring)."""

    shape: str
    mode: str
    ep: int
    nodes: int
    compute: float
    intra: float
    collective: float
    hbm: float
    total: float
    overlapped: float
    all_to_all: float

    @property
    def collective_share(self) -> float:
        """The share of the call's time in the collectives between nodes."""
        return self.collective / self.total if self.total > 0 else 0.0


def nvlink_ms(shape: MoEShape, ranks: int, links: Links) -> float:
    """Time of the NVLink bytes of one forward at ``ranks`` GPUs of a node, nothing hidden."""
    if ranks <= 1:
        return 0.0
    t, d, k = shape.tokens, shape.hidden, shape.top_k
    return 2 * t * k * d * 2 * (ranks - 1) / ranks / (links.nvlink_gbps * 1e6)


def ep2_byte_ms(shape: MoEShape, mode: str, links: Links) -> float:
    """:func:`nvlink_ms` of a call at EP=2 (twice with the backward)."""
    return nvlink_ms(shape, 2, links) * (2 if mode == "fwdbwd" else 1)


def fit_exposed(shape: MoEShape, mode: str, ep2_ratio: float, compute_ms: float,
                links: Links) -> float:
    """The share of the EP=2 NVLink time that showed: ``(ratio - 1) * compute`` over
    :func:`ep2_byte_ms`."""
    return max(0.0, (ep2_ratio - 1.0) * compute_ms / ep2_byte_ms(shape, mode, links))


def estimate(shape: MoEShape, mode: str, ep: int, compute_ms: float, links: Links,
             exposed: float = 1.0) -> Estimate | None:
    """The model's row for ``ep`` ranks (None where E does not divide by ``ep``)."""
    if ep < 1 or shape.num_experts % ep:
        return None
    n = min(ep, links.gpus_per_node)
    if ep % n:
        return None
    nodes = ep // n
    t, d, k = shape.tokens, shape.hidden, shape.top_k
    passes = 2 if mode == "fwdbwd" else 1
    nic = links.nic_gbps * links.nic_efficiency * 1e6  # bytes per ms
    intra = exposed * nvlink_ms(shape, n, links) * passes
    collective = 0.0
    hbm = 0.0
    if nodes > 1:
        gathered = (nodes - 1) * t * (2 * d + _ID_SCORE_BYTES * k)
        reduced = (nodes - 1) * t * 4 * d
        collective = passes * (gathered + reduced) / nic
        hbm = passes * nodes * t * d * 12 / (links.hbm_gbps * 1e6)
    a2a = passes * 2 * t * k * d * 2 * (ep - n) / ep / nic
    total = compute_ms + intra + collective + hbm
    overlapped = max(compute_ms + intra, collective) + hbm
    return Estimate(shape=shape.name, mode=mode, ep=ep, nodes=nodes, compute=compute_ms,
                    intra=intra, collective=collective, hbm=hbm, total=total,
                    overlapped=overlapped, all_to_all=a2a)


def ep1_times(paths: list[Path]) -> dict[tuple[str, str], tuple[MoEShape, float, str]]:
    """``(shape, mode) -> (MoEShape, ms, source)`` of distmoe's EP=1 bf16 rows in bench results
    files: the CUDA-graph figure, sampled routing before exact, the later file first."""
    found: dict[tuple[str, str], tuple[MoEShape, float, str, int]] = {}
    for path in paths:
        payload = json.loads(Path(path).read_text())
        for c in payload.get("cases", []):
            if (c.get("provider") != "distmoe" or c.get("status") != "ok"
                    or c.get("ep_size") != 1 or (c.get("precision") or "bf16") != "bf16"
                    or c.get("transport") not in (None, "", "peer")
                    or report.timing_slot(c) != "graph" or not c.get("iter_ms")):
                continue
            name = report.LEGACY_SHAPE_NAMES.get(c["shape"], c["shape"])
            rank = 1 if c.get("routing") == "sampled" else 0
            key = (name, c["mode"])
            if key in found and found[key][3] > rank:
                continue
            shape = MoEShape(name=name, tokens=c["tokens"], hidden=c["hidden"], ffn=c["ffn"],
                             num_experts=c["num_experts"], top_k=c["top_k"],
                             description="from a results file")
            found[key] = (shape, float(c["iter_ms"]), f"{path} ({c.get('routing', 'exact')})",
                          rank)
    return {k: v[:3] for k, v in found.items()}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--results", nargs="+", type=Path, required=True, metavar="FILE",
                        help="bench results.json files with distmoe's EP=1 bf16 rows")
    parser.add_argument("--ep", nargs="+", type=int, default=[8, 16, 64, 256])
    parser.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
    parser.add_argument("--nvlink-gbps", type=float, default=Links.nvlink_gbps,
                        help="NVLink GB/s per GPU and direction (default: H100 SXM's 450)")
    parser.add_argument("--nic-gbps", type=float, default=Links.nic_gbps,
                        help="NIC GB/s per GPU and direction (default 50: 400 Gb/s)")
    parser.add_argument("--nic-efficiency", type=float, default=Links.nic_efficiency,
                        help="share of the NIC rate a collective achieves (default 0.8)")
    parser.add_argument("--hbm-gbps", type=float, default=Links.hbm_gbps,
                        help="HBM GB/s (default: H100 SXM's 3350)")
    parser.add_argument("--ep2", nargs="*", default=[], metavar="SHAPE:MODE:RATIO[:EP1_MS]",
                        help="measured EP=2 / EP=1 time ratios of the same per-rank work "
                             "(peer transport; EP1_MS: the EP=1 time of that measurement, "
                             "default the --results one), which fit the share of NVLink time "
                             "not hidden; their mean is used for every shape")
    parser.add_argument("--json", type=Path, help="write the rows here")
    return parser


def _parse_ep2(items: list[str]) -> list[tuple[str, str, float, float | None]]:
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) not in (3, 4) or parts[1] not in ("fwd", "fwdbwd"):
            raise ValueError(f"--ep2 ({item!r}) must be SHAPE:MODE:RATIO[:EP1_MS] with MODE "
                             "fwd or fwdbwd")
        try:
            values = [float(v) for v in parts[2:]]
        except ValueError:
            raise ValueError(f"--ep2 ({item!r}): RATIO and EP1_MS must be numbers") from None
        if not all(math.isfinite(v) for v in values) or values[0] < 1.0 or (
                len(values) == 2 and values[1] <= 0):
            raise ValueError(f"--ep2 ({item!r}): the ratio must be >= 1 and EP1_MS positive")
        out.append((parts[0], parts[1], values[0], values[1] if len(values) == 2 else None))
    return out


def markdown(rows: list[Estimate]) -> str:
    """The rows as a markdown table (ms)."""
    lines = ["| shape | mode | EP | nodes | compute | intra | collective | hbm | total | "
             "overlapped | collective share | all-to-all (not built) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| `{r.shape}` | {r.mode} | {r.ep} | {r.nodes} | {r.compute:.2f} | "
                     f"{r.intra:.2f} | {r.collective:.2f} | {r.hbm:.2f} | {r.total:.2f} | "
                     f"{r.overlapped:.2f} | {100 * r.collective_share:.0f}% | "
                     f"{r.all_to_all:.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        links = Links(nvlink_gbps=args.nvlink_gbps, nic_gbps=args.nic_gbps,
                      nic_efficiency=args.nic_efficiency, hbm_gbps=args.hbm_gbps,
                      gpus_per_node=args.gpus_per_node)
        for name, value in asdict(links).items():
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} ({value}) must be positive")
        ep2 = _parse_ep2(args.ep2)
        times = ep1_times(args.results)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        print(f"distmoe scaling: error: {exc}", file=sys.stderr)
        return 2
    if not times:
        print("distmoe scaling: error: no EP=1 bf16 distmoe rows in --results", file=sys.stderr)
        return 2
    fits, fitted = [], []
    for name, mode, ratio, ep1_ms in ep2:
        if (name, mode) in times:
            shape, ms, _ = times[name, mode]
        elif ep1_ms is not None:
            try:
                s = get_shape(name)
            except ValueError as exc:
                print(f"distmoe scaling: error: --ep2: {exc}", file=sys.stderr)
                return 2
            shape, ms = s, 0.0
        else:
            print(f"distmoe scaling: error: --ep2 names {name} {mode} without EP1_MS, and "
                  "--results lacks it", file=sys.stderr)
            return 2
        ms = ep1_ms or ms
        fitted.append((shape, mode, ratio, ms))
        fits.append(fit_exposed(shape, mode, ratio, ms, links))
        print(f"EP=2 {name} {mode}: ratio {ratio:.3f} -> {ms * (ratio - 1):.3f} ms over "
              f"{ep2_byte_ms(shape, mode, links):.3f} ms of NVLink "
              f"bytes: exposed {fits[-1]:.2f}")
    exposed = sum(fits) / len(fits) if fits else 1.0
    if len(fits) > 1:  # the check: each measurement against the fit of the others
        for i, (shape, mode, ratio, ms) in enumerate(fitted):
            name = shape.name
            others = (sum(fits) - fits[i]) / (len(fits) - 1)
            predicted = 1 + others * ep2_byte_ms(shape, mode, links) / ms
            print(f"check {name} {mode}: EP=2 / EP=1 predicted {predicted:.3f} from the other "
                  f"fits, measured {ratio:.3f} ({100 * (predicted / ratio - 1):+.1f}%)")
    print(f"exposed share of the NVLink time: {exposed:.2f}"
          + ("" if fits else " (no --ep2: nothing hidden)"))
    rows = []
    for (_, mode), (shape, ms, _src) in sorted(times.items()):
        for ep in args.ep:
            row = estimate(shape, mode, ep, ms, links, exposed)
            if row is not None:
                rows.append(row)
    print(markdown(rows))
    print("\nsources: " + "; ".join(f"{n} {m}: {src}" for (n, m), (_, _, src)
                                    in sorted(times.items())))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(links=asdict(links), exposed=exposed,
                                             rows=[asdict(r) for r in rows]), indent=1))
    return 0
