"""The FP8 activation quantisers against the device's copy rate (issue 58: the quantisers
should run at the speed of the bytes they move).

    PYTHONPATH=src python benchmarks/quant_speed.py [--shapes dense-e32 qwen3-30b-a3b]
        [--json out/quant_speed.json]

One GPU. For each shape (T, D, F, E, K) and FP8 operand format (``mxfp8``, ``mxfp8_rebased``,
``fp8_block``), the kernels an FP8 layer runs on its ``R = T * K`` routed rows, timed from CUDA
graphs (the shared harness, :func:`distmoe.tools.bench.timing.benchmark`):

* ``quantize_2d``: ``[R, D]`` bf16 rows quantised along D (the plain quantiser);
* ``gather_quantize``: the same rows gathered from ``[T, D]`` through a row-address table
  (random routing) and quantised in one pass (the layer's W13 operand);
* ``swiglu_quantize``: ``h1 [R, 2F]`` to ``h2`` bf16 plus its FP8 form (the W2 operand).

Each is reported as ms, bytes read + written per second and that rate over the device copy
rate (:func:`distmoe.tools.bench.ceilings.device_copy`, read + write) measured in the same run.
``--json`` writes the rows with the environment (GPU, versions, git SHA, date, command).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from distmoe.kernels.scaled.gather_quant import GATHER_QUANT_FORMATS, gather_quantize
from distmoe.kernels.scaled.swiglu_quant import swiglu_quantize
from distmoe.quant.fp8_block import fp8_block_quantize_2d
from distmoe.quant.mxfp8 import mxfp8_quantize_2d, mxfp8_quantize_rebased_2d
from distmoe.tools.bench.ceilings import device_copy
from distmoe.tools.bench.report import environment
from distmoe.tools.bench.timing import TimingConfig, benchmark

SHAPES = {  # name: (T, D, F, E, K)
    "dense-e32": (8192, 4096, 2048, 32, 8),
    "qwen3-30b-a3b": (4096, 2048, 768, 128, 8),
}
QUANTIZE_2D = {"mxfp8": mxfp8_quantize_2d, "mxfp8_rebased": mxfp8_quantize_rebased_2d,
               "fp8_block": fp8_block_quantize_2d}


def _buffers(rows: int, cols: int, fmt: str, dev: torch.device):
    group, scale_dtype = GATHER_QUANT_FORMATS[fmt]
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty(rows, cols // group, dtype=scale_dtype, device=dev)
    return q, s, q.numel() + s.numel() * s.element_size()


def run_shape(shape: str, fmt: str, timing: TimingConfig, copy_gbps: float) -> list[dict]:
    T, D, F, E, K = SHAPES[shape]
    R = T * K
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    rows = x[torch.randint(0, T, (R,), device=dev, generator=g)].contiguous()
    q, s, out_bytes = _buffers(R, D, fmt, dev)
    # one segment per expert, R / E rows each (a multiple of 128): the gather's tables
    seg = torch.arange(E + 1, device=dev, dtype=torch.int32) * (R // E)
    src = torch.randint(0, T, (R,), device=dev, generator=g)
    ptrs = x.data_ptr() + src.to(torch.int64) * (D * x.element_size())
    h1 = torch.randn(R, 2 * F, device=dev, generator=g).bfloat16()
    h2 = torch.empty(R, F, dtype=torch.bfloat16, device=dev)
    hq, hs, h_out = _buffers(R, F, fmt, dev)
    cases = {
        "quantize_2d": (lambda: QUANTIZE_2D[fmt](rows, q, s), rows.nbytes + out_bytes),
        "gather_quantize": (lambda: gather_quantize(ptrs, seg, seg, q, s, format=fmt,
                                                    block_m=128),
                            rows.nbytes + out_bytes + ptrs.nbytes),
        "swiglu_quantize": (lambda: swiglu_quantize(h1, h2, hq, hs, precision=fmt),
                            h1.nbytes + h2.nbytes + h_out),
    }
    out = []
    for kernel, (fn, nbytes) in cases.items():
        res = benchmark(fn, config=timing, device=dev)
        gbps = nbytes / res.iter_ms / 1e6
        out.append({"shape": shape, "format": fmt, "kernel": kernel, "ms": res.iter_ms,
                    "method": res.method, "bytes": nbytes, "gbps": gbps,
                    "of_copy": gbps / copy_gbps})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=list(QUANTIZE_2D), choices=list(QUANTIZE_2D))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    timing = TimingConfig(num_warmup=3, num_windows=5, iters_per_window=10, capture_iters=10,
                          telemetry=False)
    dev = torch.device("cuda", torch.cuda.current_device())
    copy = device_copy(dev, timing)
    print(f"device copy (read + write): {copy.value:.0f} GB/s")
    rows = []
    for shape in args.shapes:
        for fmt in args.formats:
            for r in run_shape(shape, fmt, timing, copy.value):
                rows.append(r)
                print(f"{shape:14s} {fmt:14s} {r['kernel']:16s} {r['ms']:7.3f} ms "
                      f"{r['gbps']:6.0f} GB/s {100 * r['of_copy']:5.1f}% of copy")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": environment(), "copy_gbps": copy.value,
                                         "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
