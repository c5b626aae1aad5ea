#!/usr/bin/env python3
"""Run 56's probe: how fast TMA streams DeepSeek-V3's W13 weights (E=256 experts of [2F, D] =
[4096, 7168] bf16, 15.0 GB) from DRAM in the order each GEMM reads them, with nothing else
in the kernel (one program per SM, a ring of TMA stages, no MMA).

Modes (each tile's steps in order, tiles dealt out program by program; "/N": N stages):
  fwd     the W13 forward's order: a tile is 256 weight rows, its steps walk D in 64-column
          boxes (256 rows x 128 bytes a step)
  fwd2    the same, two steps landing in one stage (256 rows x 256 bytes a stage)
  w13     the W13 forward's own boxes: a step loads 128 gate rows and the 128 up rows F rows
          below them, 128 bytes each (a 4-stage ring is the kernel's, less its x tiles)
  dgrad   the W13 DGRAD's order: a tile is 256 columns of one expert, its steps walk the
          expert's 2F rows 64 at a time (64 rows x 512 bytes a step)
and torch's read of the same tensor (``sum``) for the read-only ceiling. Prints GB/s.

    PYTHONPATH=src python3 docs/perf/2026-12-06-run56/tma_stream.py [--experts 256]
"""
from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _coords(j, h, pid, G, K_STEPS: gl.constexpr, NC: gl.constexpr,
            ROWS_PER_EXPERT: gl.constexpr, BR: gl.constexpr, BC: gl.constexpr,
            MODE: gl.constexpr):
    """Box ``h`` of the program's ``j``-th stage."""
    if MODE == 2:  # gate and up: one step's two boxes, F rows apart
        t = pid + (j // K_STEPS) * G
        r = (t // NC) * ROWS_PER_EXPERT + (t % NC) * BR + h * (ROWS_PER_EXPERT // 2)
        c = (j % K_STEPS) * BC
    else:
        jj = j * (1 + (MODE == 3)) + h  # fwd2 (3): a stage holds two consecutive steps
        t = pid + (jj // K_STEPS) * G
        k = jj % K_STEPS
        if MODE == 1:
            r = (t // NC) * ROWS_PER_EXPERT + k * BR
            c = (t % NC) * BC
        else:
            r = t * BR
            c = k * BC
    return r, c


@gluon.jit
def _issue(desc, bufs, bars, s, j, live, pid, G, K_STEPS: gl.constexpr, NC: gl.constexpr,
           ROWS_PER_EXPERT: gl.constexpr, MODE: gl.constexpr, PER_STAGE: gl.constexpr):
    """The loads of the program's ``j``-th stage into ring stage ``s`` (if ``live``)."""
    BR: gl.constexpr = desc.block_type.shape[0]
    BC: gl.constexpr = desc.block_type.shape[1]
    mbarrier.expect(bars.index(s), PER_STAGE * desc.block_type.nbytes, pred=live)
    for h in gl.static_range(PER_STAGE):
        r, c = _coords(j, h, pid, G, K_STEPS, NC, ROWS_PER_EXPERT, BR, BC, MODE)
        tma.async_copy_global_to_shared(desc, [r, c], bars.index(s),
                                        bufs.index(s * PER_STAGE + h), live)


@gluon.jit
def _stream_kernel(desc, num_tiles, K_STEPS: gl.constexpr, NC: gl.constexpr,
                   ROWS_PER_EXPERT: gl.constexpr, MODE: gl.constexpr, PER_STAGE: gl.constexpr,
                   STAGES: gl.constexpr):
    BR: gl.constexpr = desc.block_type.shape[0]
    BC: gl.constexpr = desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES * PER_STAGE, BR, BC], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    my_tiles = (num_tiles - pid + G - 1) // G
    if MODE == 2:
        total = my_tiles * K_STEPS
    else:
        total = my_tiles * (K_STEPS // PER_STAGE)  # stages' worth of steps
    for i in gl.static_range(STAGES):
        _issue(desc, bufs, bars, i, i, i < total, pid, G, K_STEPS, NC, ROWS_PER_EXPERT, MODE,
               PER_STAGE)
    for j in range(total):
        s = j % STAGES
        mbarrier.wait(bars.index(s), (j // STAGES) & 1)
        _issue(desc, bufs, bars, s, j + STAGES, j + STAGES < total, pid, G, K_STEPS, NC,
               ROWS_PER_EXPERT, MODE, PER_STAGE)

def run(w: torch.Tensor, mode: str, stages: int, experts: int, rows: int, cols: int, sms: int):
    per_stage = 2 if mode in ("fwd2", "w13") else 1
    if mode == "dgrad":
        br, bc = 64, 256
        k_steps, nc = rows // br, cols // bc
        num_tiles = experts * nc
    elif mode == "w13":
        br, bc = 128, 64
        k_steps, nc = cols // bc, rows // 2 // br
        num_tiles = experts * nc
    else:
        br, bc = 256, 64
        k_steps, nc = cols // bc, 1
        num_tiles = experts * rows // br
    layout = gl.NVMMASharedLayout.get_default_for([br, bc], gl.bfloat16)
    desc = TensorDescriptor.from_tensor(w, [br, bc], layout)

    def launch():
        _stream_kernel[(sms,)](desc, num_tiles, K_STEPS=k_steps, NC=nc, ROWS_PER_EXPERT=rows,
                               MODE={"fwd": 0, "dgrad": 1, "w13": 2, "fwd2": 3}[mode], PER_STAGE=per_stage, STAGES=stages,
                               num_warps=4)
    return launch


def time_ms(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4096, help="2F, an expert's W13 rows")
    ap.add_argument("--cols", type=int, default=7168, help="D")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    w = torch.randn(args.experts * args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    gb = w.numel() * 2 / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fns = {"sum": lambda: w.sum(dtype=torch.float32)}
    for mode, stages in (("w13", 4), ("w13", 6), ("fwd", 6), ("fwd", 4), ("fwd2", 3),
                         ("fwd2", 2), ("dgrad", 6), ("dgrad", 4)):
        name = f"{mode}/{stages}"
        try:
            fns[name] = run(w, mode, stages, args.experts, args.rows, args.cols, sms)
            fns[name]()
        except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            fns.pop(name, None)
    print(f"{torch.cuda.get_device_name(0)}: {gb:.2f} GB, {sms} programs")
    best = {name: float("inf") for name in fns}
    for _ in range(args.rounds):  # rounds rotate over the modes
        for name, fn in fns.items():
            best[name] = min(best[name], time_ms(fn))
    for name, ms in best.items():
        print(f"{name:8s} {ms:7.3f} ms  {gb / ms * 1e3:7.0f} GB/s")  # GB per ms is TB/s


if __name__ == "__main__":
    main()
