#!/usr/bin/env python3
"""Registers and spills of the production kernel configs for sm_90a, without a GPU.

Usage (repository root, any machine with triton):
    PYTHONPATH=src python3 tools/ptxas_report.py [--shapes issue-a fine]

Compiles each grouped GEMM of the training path with the config its heuristic picks at the
named shapes (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, device-built descriptors,
the layer's constexpr flags), runs Triton's bundled ``ptxas -v`` on the PTX and prints the
registers per thread, the spill-store bytes and the shared memory. The report says whether a
kernel spills, not where: a spill in a K loop costs far more than one in an epilogue.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU target even on a CPU machine

# Parameter types by name (pointers default to bf16 tensors).
_INTS = {"num_rows", "num_act_rows", "r_act", "num_pid_m", "num_progs"}
_I64 = {"grad_h3_ptrs_ptr", "scatter_ptrs_ptr", "gather_ptrs_ptr", "h1_offset_ptr",
        "b_offset_ptr", "out_offsets_ptr"}
_I32 = {"padded_offsets_ptr", "row_offsets_ptr", "enable_ptr", "out_desc"}


def _type(name: str) -> str:
    if name in _INTS:
        return "i32"
    if name in _I64:
        return "*i64"
    if name in _I32:
        return "*i32"
    return "*bf16"


def report(label: str, kernel, constexprs: dict, num_warps: int, num_stages: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("constexpr" if n in constexprs else _type(n)) for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in kernel.arg_names if n not in constexprs and _type(n).startswith("*")}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        err = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = ",".join(re.findall(r"Used (\d+) registers", err)) or "?"
    spills = ",".join(re.findall(r"(\d+) bytes spill stores", err)) or "?"
    print(f"{label:34s} regs {regs:>4}  spill stores {spills:>5} B  "
          f"smem {compiled.metadata.shared // 1024} KiB", flush=True)


def main() -> int:
    from distmoe.kernels import w2_backward as w2b
    from distmoe.kernels import w2_scatter as w2f
    from distmoe.kernels import w13_backward as w13b
    from distmoe.kernels import w13_gather_swiglu as w13f
    from distmoe.kernels._common import next_power_of_2
    from distmoe.tools.bench.workloads import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["issue-a", "fine"], choices=sorted(SHAPES))
    args = ap.parse_args()
    for name in args.shapes:
        s = SHAPES[name]
        D, F, E = s.hidden, s.ffn, s.num_experts
        hint = s.tokens * s.top_k // E  # the layer's shape key at EP=1
        ep2 = next_power_of_2(E)
        c = w13f.W13Config.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint)
        report(f"{name} W13 fwd (training) n{c.block_n}", w13f._gather_w13_swiglu_kernel,
               dict(NUM_EXPERTS=E, EXPERTS_POW2=ep2, HIDDEN=D, FFN=F, BLOCK_M=c.block_m,
                    BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, EVEN_K=True,
                    EVEN_N=True, PERSISTENT=c.persistent, HOST_DESC=False, WRITE_H1=True,
                    WRITE_X=True, DYN_OFFSETS=True, HAS_ENABLE=True),
               c.num_warps, c.num_stages)
        c = w2f.W2Config.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint)
        report(f"{name} W2 fwd n{c.block_n}", w2f._w2_scatter_kernel,
               dict(NUM_EXPERTS=E, EXPERTS_POW2=ep2, HIDDEN=D, FFN=F, BLOCK_M=c.block_m,
                    BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, EVEN_N=True,
                    PERSISTENT=c.persistent, HOST_DESC=False, HAS_ENABLE=True),
               c.num_warps, c.num_stages)
        c = w13b.W13DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint)
        report(f"{name} W13 DGRAD n{c.block_n}", w13b._w13_dgrad_scatter_kernel,
               dict(HIDDEN=D, FFN=F, NUM_EXPERTS=E, EXPERTS_POW2=ep2, HOST_DESC=False,
                    PERSISTENT=c.persistent, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                    BLOCK_K=c.block_k, GROUP_M=c.group_m),
               c.num_warps, c.num_stages)
        c = w2b.W2DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=hint)
        report(f"{name} W2 DGRAD n{c.block_n}", w2b._w2_dgrad_swiglu_kernel,
               dict(HIDDEN=D, FFN=F, NUM_EXPERTS=E, EXPERTS_POW2=ep2, GATHER_IN_LOOP=False,
                    STORE_H2=True, HOST_DESC=False, H1_OFFSET=True, PERSISTENT=c.persistent,
                    BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                    GROUP_M=c.group_m),
               c.num_warps, c.num_stages)
        for kind, P, Q in (("W13", 2 * F, D), ("W2", D, F)):
            c = w2b.WgradConfig.from_heuristic(out_rows=P, out_cols=Q, rows_per_expert=hint)
            report(f"{name} {kind} WGRAD {c.block_out_m}x{c.block_out_n}",
                   w2b._grouped_wgrad_kernel,
                   dict(P=P, Q=Q, NUM_EXPERTS=E, SPLIT_ROWS=1, OVERWRITE=True, TMA_STORE=True,
                        INTERPRETED=False, HOST_DESC=False, B_OFFSET=kind == "W13",
                        BLOCK_K=c.block_k, BLOCK_P=c.block_out_m, BLOCK_Q=c.block_out_n),
                   c.num_warps, c.num_stages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
