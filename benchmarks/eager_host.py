"""Eager calls against CUDA-graph replay: host time per call and wall time per call (issue 66).

    PYTHONPATH=src python benchmarks/eager_host.py [--shapes ...] [--calls 30] [--out DIR]

One process, one GPU, EP=1, sampled routing (each token draws K distinct experts). For each
shape and mode (``fwd``: inference forward; ``fwdbwd``: training forward + backward through
``torch.autograd.grad``) it times:

* ``host_ms``: host time per call, the wall time of ``--calls`` back-to-back calls issued
  while the GPU is kept busy by a long sleep kernel queued first, divided by the count (so
  the host never waits for the GPU);
* ``wall_ms``: wall time per call of back-to-back calls, GPU synchronised at both ends;
* ``graph_ms``: the same calls captured into one CUDA graph by the caller and replayed;
* for forwards, ``weights_pct_copy``: the expert weights' bytes over ``wall_ms``, in percent
  of the device copy rate (``dst.copy_(src)`` of 2 GiB, read + write bytes) measured once
  at the start of the run (the decode target of issue 66).

Providers: ``distmoe`` (the context's own graphs on, the default), ``distmoe-nog``
(``MoEContext(..., graphs=False)``: every call through the launch path), in training
``distmoe-mg`` (``main_grad=True``: weight gradients added into fp32 ``main_grad`` buffers),
``distmoe-wb`` (``TrainingGraphs.whole_backward``: one graph of the whole backward per
weight-gradient outputs, not three) and ``torch`` (the
grouped-GEMM baseline of :mod:`distmoe.tools.bench.baseline`). Results go to stdout and,
with ``--out``, to ``eager_host.json`` with the GPU, versions, date and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

SHAPES = {  # name: (T, D, F, E, K)
    "qwen3-30b-a3b": (4096, 2048, 768, 128, 8),
    "decode-dense-e32": (64, 4096, 2048, 32, 8),
    "dense-e32": (8192, 4096, 2048, 32, 8),
}


def _inputs(T, D, F, E, K, training, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int32)
    scores = torch.softmax(torch.rand(T, K, device=dev, generator=g), dim=1)
    w13 = (torch.randn(E, 2, F, D, device=dev, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device=dev, generator=g) / F**0.5).bfloat16()
    gy = torch.randn(T, D, device=dev, generator=g).bfloat16()
    if training:
        for t in (scores, w13, w2):
            t.requires_grad_(True)
    return x, ids, scores, w13, w2, gy


def _step_fn(layer, inputs, training):
    x, ids, scores, w13, w2, gy = inputs

    def step():
        if training:
            xs = x.detach().requires_grad_(True)
            y = layer(xs, ids, scores, w13, w2)
            # main_grad: the weights' gradients go to their main_grad buffers
            wanted = (xs, scores) if getattr(layer, "main_grad", False) else (xs, scores, w13, w2)
            torch.autograd.grad(y, wanted, gy)
        else:
            with torch.no_grad():
                layer(x, ids, scores, w13, w2)
    return step


def _host_ms(step, calls):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU work queued ahead of the calls
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    host = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return host


def _wall_ms(step, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def _graph_ms(step, calls):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def _cprofile(step, calls, label, out):
    import cProfile
    import io
    import pstats

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    text = f"== {label}: {calls} calls\n" + buf.getvalue()
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"cprofile_{label.replace(' ', '_')}.txt"), "w") as f:
            f.write(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    p.add_argument("--out", default=None)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="instead of timing: cProfile N eager distmoe calls of each shape and "
                        "mode (host time by Python function, top 45 by own time)")
    args = p.parse_args(argv)
    import torch.distributed as dist

    import distmoe as dm
    from distmoe.tools.bench.baseline import torch_moe

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if not dist.is_initialized():
        store = dist.FileStore(f"/tmp/eager_host_{os.getpid()}", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from distmoe.tools.bench.ceilings import device_copy
    from distmoe.tools.bench.timing import TimingConfig

    copy_gbps = device_copy(dev, TimingConfig()).value
    print(f"device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    rows = []
    for name in args.shapes:
        T, D, F, E, K = SHAPES[name]
        for mode in args.modes:
            training = mode == "fwdbwd"
            inputs = _inputs(T, D, F, E, K, training, dev)
            cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                               training=training)
            providers = {"torch": lambda *a: torch_moe(*a)}
            ctxs = [dm.MoEContext(cfg, device=dev)]
            providers["distmoe"] = ctxs[0]
            ctxs.append(dm.MoEContext(cfg, device=dev, graphs=False))
            providers["distmoe-nog"] = ctxs[1]
            if training:
                for w in inputs[3:5]:
                    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
                ctxs.append(dm.MoEContext(cfg, device=dev, main_grad=True))
                providers["distmoe-mg"] = ctxs[2]
                ctxs.append(dm.MoEContext(cfg, device=dev))
                ctxs[3].graphs.whole_backward = True
                providers["distmoe-wb"] = ctxs[3]
            if args.cprofile:
                _cprofile(_step_fn(ctxs[0], inputs, training), args.cprofile,
                          f"{name} {mode}", args.out)
                for c in ctxs:
                    c.close()
                continue
            for prov, layer in providers.items():
                step = _step_fn(layer, inputs, training)
                for _ in range(3):  # compile, capture the context's graphs, warm
                    step()
                t0 = time.time()
                host = statistics.median(_host_ms(step, args.calls) for _ in range(args.rounds))
                wall = statistics.median(_wall_ms(step, args.calls) for _ in range(args.rounds))
                try:
                    graph = _graph_ms(step, args.calls)
                except Exception as exc:  # noqa: BLE001 - a provider that cannot be captured
                    graph = float("nan")
                    print(f"  {prov}: graph capture failed: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
                pct = None
                if not training and copy_gbps:
                    weight_bytes = (3 * E * F * D) * 2  # w13 and w2, bf16
                    pct = 100 * weight_bytes / (wall * 1e-3) / 1e9 / copy_gbps
                rows.append(dict(shape=name, T=T, D=D, F=F, E=E, K=K, mode=mode,
                                 provider=prov, host_ms=host, wall_ms=wall, graph_ms=graph,
                                 weights_pct_copy=pct))
                extra = "" if pct is None else f"  weights {pct:5.1f}% of copy"
                print(f"{name:18s} {mode:7s} {prov:12s} host {host:7.3f} ms  wall "
                      f"{wall:7.3f} ms  graph {graph:7.3f} ms{extra}  "
                      f"({time.time() - t0:.1f} s)", flush=True)
            for c in ctxs:
                c.close()
            del inputs
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        env = dict(gpu=torch.cuda.get_device_name(dev), torch=torch.__version__,
                   device_copy_gbps=copy_gbps,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   command=" ".join(sys.argv))
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            pass
        with open(os.path.join(args.out, "eager_host.json"), "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
