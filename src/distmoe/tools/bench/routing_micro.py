"""``python -m distmoe bench --routing-micro``: time the routing-table construction per
implementation (torch ops, one Triton program, blocked Triton) on one device.

For each named bench shape and token count, builds the tables of rank 0 from random ids of
``EP`` ranks (``EP*T*K`` routes, each token drawing K distinct experts; the receive bound of
the default ``device_scratch_factor`` 2) with each implementation, checks that all give the
same tables, and times each with ``triton.testing.do_bench_cudagraph`` (CUDA-graph replay, as
the layer runs under graphs). One row per case and implementation, fastest first within a
case. On the CPU (Triton's interpreter) each is called once: a smoke run, not a measurement.
"""

from __future__ import annotations

import math
import time

import torch

from .workloads import SHAPES

DEFAULT_SHAPES = ("qwen3-30b-a3b", "dense-e32")
DEFAULT_TOKENS = (16, 128, 512, 4096)
COLUMNS = ("shape", "tokens", "ep", "routes", "experts", "impl", "ms", "r_cap")


def check(shapes: tuple[str, ...], tokens: tuple[int, ...], ep: int) -> None:
    """ValueError naming the option: EP or a token count below 1, or an EP that divides no
    shape's expert count (nothing to time)."""
    if ep < 1:
        raise ValueError(f"--routing-ep ({ep}) must be >= 1")
    if any(t < 1 for t in tokens):
        raise ValueError(f"--tokens values ({' '.join(map(str, tokens))}) must be >= 1")
    if all(SHAPES[n].num_experts % ep for n in shapes):
        raise ValueError(f"--routing-ep {ep} divides the expert count of none of the shapes "
                         f"({', '.join(f'{n}: E={SHAPES[n].num_experts}' for n in shapes)})")


def run(shapes: tuple[str, ...], tokens: tuple[int, ...], ep: int,
        device: torch.device) -> list[dict]:
    """Build, check and time (module docstring); prints the table, returns its rows."""
    from distmoe.reference import random_routing
    from distmoe.routing import build_routing_tables, row_capacity
    from distmoe.routing.fused import MAX_FUSED_ROUTES, fused_eligible

    from .. import INTERPRETER_NOTE

    check(shapes, tokens, ep)
    cuda = device.type == "cuda"
    rows = []
    for name in shapes:
        s = SHAPES[name]
        E, K = s.num_experts, s.top_k
        if E % ep:
            print(f"{name}: E={E} not divisible by --routing-ep {ep}; skipped")
            continue
        for T in tokens:
            g = torch.Generator().manual_seed(T)
            ids = torch.stack([random_routing(T, E, K, generator=g)[0]
                               for _ in range(ep)]).to(torch.int16).to(device)
            bound = min(math.ceil(2.0 * T * K), ep * T * min(K, E // ep))
            bases = torch.arange(ep, dtype=torch.int64, device=device) * 2**30 + 2**20
            kw = dict(rank=0, num_local_experts=E // ep, row_block=128, receive_bound=bound,
                      dispatch_bases_EP=bases, combine_bases_EP=bases + 2**29,
                      row_bytes=s.hidden * 2, training=True)
            impls = ["torch", "blocked"]
            if fused_eligible(ep * T * K, E, device):
                impls.insert(1, "fused")
            want = build_routing_tables(ids, impl="torch", **kw)
            for impl in impls[1:]:
                got = build_routing_tables(ids, impl=impl, **kw)
                for field in want.__dataclass_fields__:
                    a, b = getattr(want, field), getattr(got, field)
                    if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                        raise RuntimeError(f"{name} T={T}: impl {impl!r} differs in {field}")
            case = []
            for impl in impls:
                def fn(impl=impl, ids=ids, kw=kw):
                    build_routing_tables(ids, impl=impl, **kw)
                if cuda:
                    import triton.testing

                    ms = triton.testing.do_bench_cudagraph(fn, rep=50)
                else:
                    start = time.perf_counter()
                    fn()
                    ms = (time.perf_counter() - start) * 1e3
                case.append(dict(shape=name, tokens=T, ep=ep, routes=ep * T * K, experts=E,
                                 impl=impl, ms=ms, r_cap=row_capacity(bound, E // ep, 128)))
            case.sort(key=lambda r: r["ms"])
            rows += case
    where = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    print(f"routing tables of rank 0, {where}; one-program path up to {MAX_FUSED_ROUTES} "
          "routes")
    print(f"{'shape':<20} {'T':>6} {'EP':>3} {'routes':>7} {'impl':<8} {'ms':>9}")
    for r in rows:
        print(f"{r['shape']:<20} {r['tokens']:>6} {r['ep']:>3} {r['routes']:>7} "
              f"{r['impl']:<8} {r['ms']:>9.4f}")
    if not cuda:
        print(f"note: {INTERPRETER_NOTE}")
    return rows
