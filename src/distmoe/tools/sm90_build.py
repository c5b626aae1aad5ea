"""sm_90 builds of the grouped-GEMM kernels without a GPU: compile errors and register spills.

The Triton interpreter runs a kernel's Python on the CPU. It therefore misses what only the
compiler sees: a ``constexpr`` branch ending in ``return`` is still built for the other
value, and a descriptor-typed argument can reach a pointer-only op. It also says nothing
about registers. This module compiles kernels for ``GPUTarget("cuda", 90, 32)`` and runs
Triton's bundled ``ptxas -v`` on the PTX. Both need ``TRITON_INTERPRET=0`` when Triton is
imported, so run it as its own process: ``tools/ptxas_report.py``.

:func:`grouped_gemm_cases` lists the five grouped GEMMs of the training path (W13 and W2
forward, both DGRADs, the grouped WGRAD):

* *production* cases: the config each heuristic picks at a named shape, with the constexpr
  flags and descriptor kinds the layer launches with. A spill there is a failure.
* *variant* cases at the ``qwen3-30b-a3b`` shape: the other flag combinations the launchers can
  select (device-built descriptors, one program per tile, inference outputs, the in-loop
  gather, split-row atomics). These only have to build.

:func:`other_kernel_cases` lists the rest of the library's kernels (combine, route gradients,
row gather, offset copy, token pull, routing tables, slot cursor, device barrier) at the
``qwen3-30b-a3b`` shape
with every flag value their launchers pass, and :func:`lowp_kernel_cases` the low-precision
kernels (the block-scaled GEMM in each scale layout, the NVFP4-weight GEMM, the quantisers, the
scaled rowwise moves). They only have to build.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

#: Shared memory one sm_90 thread block can use (227 KiB).
SM90_SMEM_BYTES = 227 * 1024

# Non-constexpr parameters: types by name (pointers default to bf16 tensors).
_INTS = {"num_rows", "num_act_rows", "r_act", "num_pid_m", "num_progs", "need"}
_I64 = {"grad_h3_ptrs_ptr", "scatter_ptrs_ptr", "gather_ptrs_ptr", "h1_offset_ptr",
        "b_offset_ptr", "out_offsets_ptr", "b_rows_ptr"}
_I64_SCALARS = {"b_shift"}
_I32 = {"padded_offsets_ptr", "row_offsets_ptr", "enable_ptr", "order_ptr", "positions_ptr",
        "done_ptr", "next_ptr", "sync_ptr"}


#: the WGRAD kernels' address-table arguments when B is not gathered (placeholder tensors and
#: a 0 shift; gathered, the name-based defaults above apply)
_NO_ADDRESS_TABLE = {"b_rows_ptr": "*i32", "padded_offsets_ptr": "*i32", "b_shift": "i32"}


def _default_type(name: str) -> str:
    if name in _INTS:
        return "i32"
    if name in _I64_SCALARS:
        return "i64"
    if name in _I64:
        return "*i64"
    if name in _I32:
        return "*i32"
    return "*bf16"


def _desc(*block: int) -> str:
    """Signature type of a host-built bf16 TMA descriptor with this block shape."""
    return f"tensordesc<bf16[{','.join(str(b) for b in block)}]>"


@dataclass(frozen=True)
class BuildCase:
    """One kernel build: non-constexpr parameter types (``types`` overrides the name-based
    defaults, e.g. with host-descriptor types), constexpr values, launch options, and whether
    spills are a failure."""

    label: str
    kernel: object  # triton JITFunction
    constexprs: dict
    num_warps: int
    num_stages: int
    types: dict = field(default_factory=dict)
    production: bool = False
    gluon: bool = False  # a Gluon kernel (built from GluonASTSource)
    options: dict = field(default_factory=dict)  # more compile options (e.g. maxnreg)


@dataclass
class BuildReport:
    """What the build gave: registers per thread, spill-store bytes, shared memory (bytes), or
    the error that stopped it."""

    case: BuildCase
    regs: int | None = None
    spill_bytes: int | None = None
    smem_bytes: int | None = None
    error: str = ""
    #: ptxas serialized the wgmma pipeline (its C75xx "Potential Performance Loss" notes)
    wgmma_serialized: bool = False

    @property
    def ok(self) -> bool:
        """Built and fits an SM's 227 KiB of shared memory; a production case also spills
        nothing and keeps its wgmma pipeline."""
        return not self.error and (self.smem_bytes or 0) <= SM90_SMEM_BYTES and not (
            self.case.production and (self.spill_bytes or self.wgmma_serialized))


def wgmma_serialized(ptxas_stderr: str) -> bool:
    """Whether ``ptxas -v`` reports a serialized wgmma pipeline. ptxas gives one code per
    cause (C7514: a non-wgmma instruction touching an in-flight accumulator; C7515: one
    defining an accumulator register between a pipeline stage's start and end; others), all
    with the same sentence, so the sentence is matched, not a code."""
    return "wgmma.mma_async instructions are serialized" in ptxas_stderr


def build(case: BuildCase) -> BuildReport:
    """Compile ``case`` for sm_90 and read ``ptxas -v``; errors are reported, not raised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return BuildReport(case, error="TRITON_INTERPRET is set: run in a process without it")
    kernel = case.kernel
    sig, attrs = {}, {}
    constexprs = dict(case.constexprs)
    for i, name in enumerate(kernel.arg_names):
        param = kernel.params[i] if hasattr(kernel, "params") else None
        if (name not in constexprs and param is not None and param.is_constexpr
                and param.has_default):
            # a constexpr left to its default is built as the launch would build it, never
            # as a run-time argument (which would keep both sides of its branches)
            constexprs[name] = param.default
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = case.types.get(name, _default_type(name))
        if sig[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    report = BuildReport(case)
    source_type = ASTSource
    if case.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    # Triton's own cubin step runs `ptxas -v` and prints its log when asked: read it there
    # rather than run ptxas a second time (a third of a build's time)
    log = io.StringIO()
    dump = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                source_type(kernel, sig, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=case.num_warps, num_stages=case.num_stages,
                             **case.options),
            )
    except Exception as exc:  # a build failure is the result
        report.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return report
    finally:
        triton.knobs.nvidia.dump_ptxas_log = dump
    report.smem_bytes = compiled.metadata.shared
    rc, text = 0, log.getvalue()
    if not re.search(r"Used \d+ registers", text):  # from Triton's cache: no ptxas ran
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "ptxas")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ptx")
            with open(path, "w") as f:
                f.write(compiled.asm["ptx"])
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                                 capture_output=True, text=True)
        rc, text = out.returncode, out.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    if rc or not regs or not spills:
        report.error = f"ptxas (rc {rc}): {text.strip()[:200]}"
        return report
    report.regs, report.spill_bytes = int(regs[0]), int(spills[0])
    report.wgmma_serialized = wgmma_serialized(text)
    return report


def _gluon_desc(rows: int, cols: int, block: list[int], planes: int | None = None,
                fp8: bool = False) -> str:
    """Signature type of a host-built Gluon TMA descriptor over a bf16 (``fp8``: E4M3)
    ``[rows, cols]`` tensor (``[planes, rows, cols]`` with ``planes``) with this block (the
    default NVMMA shared layout)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv if fp8 else gl.bfloat16)
    shape = [rows, cols] if planes is None else [planes, rows, cols]
    t = torch.empty(*shape, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    strides = [cols, 1] if planes is None else [rows * cols, cols, 1]
    return mangle_type(TensorDescriptor(t, shape, strides, block, layout))


def gluon_wgrad_cases(shapes: tuple[str, ...] = ("dense-e32", "qwen3-30b-a3b")) -> list[BuildCase]:
    """The persistent Gluon WGRAD (:mod:`distmoe.kernels.wgrad.gluon`): the config the Hopper
    heuristic picks for W13 (x at a device offset) and W2 at each shape and at gpt-oss-120b
    (production: no spills, no serialized wgmma), then every other tuner config at ``qwen3-30b-a3b``
    (build only)."""
    from distmoe.kernels.wgrad import gluon as wg
    from distmoe.plan import rules
    from distmoe.tools.bench.workloads import SHAPES

    if not wg.HAVE_GLUON:
        return []
    gl = wg.gl

    def case(label, P, Q, E, bp, bq, stages, warps, b_offset, production, bk=64, ws=False,
             pp=False, gather=False, ls=False):
        b_layout = gl.NVMMASharedLayout.get_default_for([bk, bq], gl.bfloat16)
        c_layout = gl.NVMMASharedLayout.get_default_for([bp, bq], gl.bfloat16)
        types = {"a_desc": _gluon_desc(bk, P, [bk, bp]),
                 "o_desc": (_gluon_desc(P, Q, [1, bp, bq], planes=E) if P % bp
                            else _gluon_desc(E * P, Q, [bp, bq])),
                 "b_desc": (_gluon_desc(bk, P, [bk, bp]) if b_offset
                            else _gluon_desc(bk, Q, [bk, bq])),
                 "b_base": "*bf16" if b_offset else "*i32",
                 "b_offset_ptr": "*i64" if b_offset else "*i32"}
        if ws and not gather:
            types.update(_NO_ADDRESS_TABLE)
        return BuildCase(
            label, wg._gluon_wgrad_ws_kernel if ws else wg._gluon_wgrad_kernel,
            dict(P=P, Q=Q, NUM_EXPERTS=E, B_OFFSET=b_offset, B_LAYOUT=b_layout,
                 C_LAYOUT=c_layout, BLOCK_K=bk,
                 BLOCK_P=bp, BLOCK_Q=bq, STAGES=stages, num_warps=warps,
                 **({"ZERO_WARPS": wg.WS_ZERO_WARPS, "PINGPONG": pp, "GATHER_B": gather,
                     "PRODUCER_WARPS": wg.WS_GATHER_WARPS if gather else 1,
                     "LOCKSTEP": ls} if ws else {})),
            warps, 1, types=types, production=production, gluon=True,
            options=dict(maxnreg=wg.ws_maxnreg(warps, pp, gather)) if ws else {})

    cases = []
    # and gpt-oss-120b, whose W2 WGRAD (P = D = 2880) stores each expert's last row block
    # clipped (a 3-D output descriptor)
    for name in dict.fromkeys((*shapes, "gpt-oss-120b")):
        s = SHAPES[name]
        D, F, E = s.hidden, s.ffn, s.num_experts
        hint = s.tokens * s.top_k // E
        for kind, P, Q in (("W13", 2 * F, D), ("W2", D, F)):
            c = rules.wgrad_gluon(out_rows=P, out_cols=Q, rows_per_expert=hint)
            if c is None:  # the Triton WGRAD serves this shape (P under 128)
                continue
            # the warp-specialised kernel as picked (256 x 128 tiles from 12 MiB per
            # expert; else ping-pong below 1024 rows per expert, two cooperating warpgroups
            # above), and the plain kernel of the same tile with 8 warps. 128 x 256 tiles
            # only in the plain kernel (the warp-specialised one needs more registers there).
            for ws in (False, True) if c.block_out_n <= 128 else (False,):
                pp = ws and c.pingpong
                cases.append(case(f"{name} {kind} WGRAD gluon{' ws' if ws else ''}"
                                  f"{' pingpong' if pp else ''} {c.block_out_m}x{c.block_out_n}",
                                  P, Q, E,
                                  c.block_out_m, c.block_out_n, c.num_stages,
                                  c.num_warps if ws or not c.pingpong else 8,
                                  kind == "W13", True, c.block_k, ws, pp))
            if kind == "W13":  # x's rows read in place (EP = 1, x kept): as picked for it
                g = rules.wgrad_gluon(out_rows=P, out_cols=Q, rows_per_expert=hint,
                                                 gathered_b=True)
                cases.append(case(f"{name} W13 WGRAD gluon ws{' pingpong' if g.pingpong else ''}"
                                  f" {g.block_out_m}x{g.block_out_n} x_rows", P, Q, E,
                                  g.block_out_m, g.block_out_n, g.num_stages, g.num_warps, True,
                                  True, g.block_k, True, g.pingpong, gather=True))
    s = SHAPES["qwen3-30b-a3b"]
    # two cooperating warpgroups: the pick from 1024 rows per expert below 12 MiB per expert
    # (qwen3-30b-a3b at T=16384)
    c = rules.wgrad_gluon(out_rows=2 * s.ffn, out_cols=s.hidden, rows_per_expert=1024)
    cases.append(case(f"qwen3-30b-a3b T=16384 W13 WGRAD gluon ws {c.block_out_m}x{c.block_out_n} "
                      f"w{c.num_warps} s{c.num_stages}", 2 * s.ffn, s.hidden, s.num_experts,
                      c.block_out_m, c.block_out_n, c.num_stages, c.num_warps, True, True,
                      c.block_k, True, c.pingpong))
    # the producers in lockstep (WgradConfig.lockstep), as picked for deepseek-v3's W13 (56 MiB
    # an expert)
    d = SHAPES["deepseek-v3"]
    c = rules.wgrad_gluon(out_rows=2 * d.ffn, out_cols=d.hidden, rows_per_expert=128)
    cases.append(case(f"deepseek-v3 W13 WGRAD gluon ws {c.block_out_m}x{c.block_out_n}"
                      f"{' lockstep' if c.lockstep else ''}", 2 * d.ffn, d.hidden,
                      d.num_experts, c.block_out_m, c.block_out_n, c.num_stages, c.num_warps,
                      True, True, c.block_k, True, c.pingpong, ls=c.lockstep))
    for bp, bq, stages, warps, bk in wg.GLUON_WGRAD_CONFIGS:
        cases.append(case(f"variant W2 WGRAD gluon {bp}x{bq} k{bk} s{stages} w{warps}",
                          s.hidden, s.ffn, s.num_experts, bp, min(bq, s.ffn), stages, warps,
                          False, False, bk))
    return cases


def gluon_w13_cases(shapes: tuple[str, ...] = ("dense-e32", "qwen3-30b-a3b")) -> list[BuildCase]:
    """The warp-specialised Gluon W13 forward (:mod:`distmoe.kernels.w13_forward.gluon`): what the
    plan picks on Hopper at each shape (:func:`distmoe.plan.rules.w13_forward_gluon`:
    cooperative tiles at both named shapes), with h1 and the rows
    saved at device offsets and an enable flag in training (production: no spill, no
    serialized wgmma), and deepseek-v3's training build (256 experts: the producer's bounds
    loaded per tile) where it is not among ``shapes``, each with the producers in lockstep
    where the heuristic sets it (gpt-oss-120b and deepseek-v3: 128 rows per expert); then
    (build only) at ``qwen3-30b-a3b`` the 64 x 128 consumer tile with its deepest ring, a 3-stage
    inference build and the 6-stage 128 x 64 training build (what the heuristic picks below
    128 rows per expert), and the 5-stage 128 x 64 tile at each shape. The expert-group
    tile order (``W13Config.expert_groups``) where the heuristic sets it, and (build only)
    in a cooperative inference build at ``qwen3-30b-a3b``."""
    from distmoe.kernels.base.config import next_power_of_2
    from distmoe.kernels.w13_forward import gluon as wg
    from distmoe.tools.bench.workloads import SHAPES

    if not wg.HAVE_GLUON:
        return []
    gl = wg.gl

    def case(label, name, train, bn, stages, production, warps=4, order=False, lockstep=False,
             expert_groups=False):
        s = SHAPES[name]
        D, F, E = s.hidden, s.ffn, s.num_experts
        bm, bk = wg.tile_rows(bn, warps), 64
        types = {"w_desc": _gluon_desc(2 * E * F, D, [bn, bk]),
                 "gather_ptrs_ptr": "*i64",
                 "out_offsets_ptr": "*i64" if train else "*i32",
                 "enable_ptr": "*i32"}
        return BuildCase(
            f"{label} W13 fwd gluon {bm}x{bn}{' coop' if warps == 8 else ''} s{stages} "
            f"training={train}{' ordered' if order else ''}"
            f"{' lockstep' if lockstep else ''}{' expert-groups' if expert_groups else ''}",
            wg._gluon_w13_kernel,
            dict(FFN=F, HIDDEN=D, NUM_EXPERTS=E, EXPERTS_POW2=max(32, next_power_of_2(E)),
                 GROUP_M=8, STAGES=stages, WRITE_H1=train, WRITE_X=train, DYN_OFFSETS=train,
                 HAS_ENABLE=train, HAS_ORDER=order,
                 A_LAYOUT=gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16),
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRODUCER_THREADS=wg._PRODUCER_THREADS,
                 COOP=warps == 8, LOCKSTEP=lockstep, EXPERT_GROUPS=expert_groups,
                 num_warps=4),
            4, 1, types=types, production=production, gluon=True,
            options=dict(maxnreg=wg._MAXNREG))

    from distmoe.plan import rules

    def pick(name, train):
        """The heuristic's Gluon config at the named shape's hint (or None)."""
        s = SHAPES[name]
        return rules.w13_forward_gluon(hidden=s.hidden, ffn=s.ffn, training=train,
                                      rows_per_expert=s.tokens * s.top_k // s.num_experts)

    cases = []
    # and gpt-oss-120b, whose F (2880) leaves each row's last column tile partial
    for name in dict.fromkeys((*shapes, "gpt-oss-120b")):
        for train in (True, False):
            c = pick(name, train)
            if c is not None:
                # (the producers in lockstep where the heuristic sets W13Config.lockstep)
                cases.append(case(name, name, train, c.block_n, c.num_stages, True,
                                  warps=c.num_warps, lockstep=c.lockstep,
                                  expert_groups=c.expert_groups))
                # EP > 1 with every peer token copied: two launches over a block order
                cases.append(case(name, name, train, c.block_n, c.num_stages, True,
                                  warps=c.num_warps, order=True, lockstep=c.lockstep,
                                  expert_groups=c.expert_groups))
    c = None if "deepseek-v3" in shapes else pick("deepseek-v3", True)
    if c is not None:
        # 256 experts: the producer loads the per-expert bounds per tile (production build:
        # holding them spilled 4 bytes)
        cases.append(case("deepseek-v3", "deepseek-v3", True, c.block_n, c.num_stages, True,
                          warps=c.num_warps, lockstep=c.lockstep,
                          expert_groups=c.expert_groups))
    cases.append(case("variant qwen3-30b-a3b", "qwen3-30b-a3b", True, 128, 5, False))
    # the expert-group tile order (W13Config.expert_groups), cooperative, in lockstep
    cases.append(case("variant qwen3-30b-a3b", "qwen3-30b-a3b", False, 128, 4, False, warps=8, lockstep=True,
                      expert_groups=True))
    cases.append(case("variant qwen3-30b-a3b", "qwen3-30b-a3b", False, 64, 3, False))
    cases.append(case("variant qwen3-30b-a3b", "qwen3-30b-a3b", True, 64, 6, False))
    for name in shapes:  # the ping-pong 128 x 64 tile, training and inference
        for train in (True, False):
            cases.append(case(f"variant {name}", name, train, 64, 5, False))
    return cases


#: (epilogue warps, fp32 tile buffers, ring stages) of the split W2 DGRAD's builds; the
#: plan's: 8 warps, one buffer, 4 or 5 stages
GLUON_W2_DGRAD_SPLIT_CASES = ((4, 1, 5), (8, 1, 5), (8, 1, 4), (8, 2, 3))


def gluon_w2_dgrad_cases(shapes: tuple[str, ...] = ("dense-e32", "qwen3-30b-a3b")) -> list[BuildCase]:
    """The warp-specialised Gluon W2 DGRAD (:mod:`distmoe.kernels.w2_dgrad.gluon`) at each
    shape with h1 at a device offset and h2 stored. Production (no spill, no serialized
    wgmma): the split kernel as the plan picks it (8 epilogue warps, one fp32 tile
    buffer, 4 or 5 stages), scored (the layer's) and plain, at every shape but
    ``smoke`` (a CPU test size). Built only: the other split forms (scored), and the
    ping-pong kernel (no longer picked) at every ring depth it takes. In the
    ping-pong kernel above 32 experts the consumers load the per-expert bounds per tile
    (``RELOAD_BOUNDS``; held in registers they made the scored epilogue spill), and its
    plain form still spills 16 bytes there; at ``smoke``
    (D = 64) its epilogue spills 584-596 bytes. The split kernel spills in none of these.
    Then the split kernel as picked at gpt-oss-120b (F = 2880: partial last column tiles),
    and at deepseek-v3 (scored), its TMA producer in lockstep."""
    from distmoe.kernels.base.config import next_power_of_2
    from distmoe.kernels.w2_dgrad import gluon as wg
    from distmoe.tools.bench.workloads import SHAPES

    if not wg.HAVE_GLUON:
        return []

    def split_case(name, epi, bufs, stages, scored, production, lockstep=False,
                   expert_groups=False):
        s = SHAPES[name]
        D, F, E = s.hidden, s.ffn, s.num_experts
        bm, bn, bk = 128, 128, 64
        types = {"a_desc": _gluon_desc(1024, D, [bm, bk]),
                 "w_desc": _gluon_desc(E * D, F, [bk, bn]),
                 "ptrs_ptr": "*i64", "h1_offset_ptr": "*i64"}
        maxnreg, epi_regs = wg.SPLIT_REGISTERS[epi]
        return BuildCase(
            f"{name} W2 DGRAD gluon split epi{epi} x{bufs} s{stages}"
            f" scored={scored}{' lockstep' if lockstep else ''}"
            f"{' expert-groups' if expert_groups else ''}",
            wg._gluon_w2_dgrad_split_kernel,
            dict(FFN=F, HIDDEN=D, NUM_EXPERTS=E, EXPERTS_POW2=max(32, next_power_of_2(E)),
                 GROUP_M=8, STAGES=stages, H1_OFFSET=True, STORE_H2=True, SCORED=scored,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, RELOAD_BOUNDS=E > 32, ACC_BUFS=bufs,
                 EPI_WARPS=epi, EPI_REGS=epi_regs, LOCKSTEP=lockstep,
                 EXPERT_GROUPS=expert_groups, num_warps=4),
            4, 1, types=types, production=production, gluon=True,
            options=dict(maxnreg=maxnreg))

    cases = []
    for name in shapes:
        s = SHAPES[name]
        D, F, E = s.hidden, s.ffn, s.num_experts
        for bm, bn, bk, stages in wg.GLUON_W2_DGRAD_CONFIGS:
            types = {"a_desc": _gluon_desc(1024, D, [bm, bk]),
                     "w_desc": _gluon_desc(E * D, F, [bk, bn]),
                     "ptrs_ptr": "*i64", "h1_offset_ptr": "*i64"}
            for scored in (True, False):  # the layer's, and the plain contract
                cases.append(BuildCase(
                    f"{name} W2 DGRAD gluon s{stages} scored={scored}",
                    wg._gluon_w2_dgrad_kernel,
                    dict(FFN=F, HIDDEN=D, NUM_EXPERTS=E,
                         EXPERTS_POW2=max(32, next_power_of_2(E)), GROUP_M=8, STAGES=stages,
                         H1_OFFSET=True, STORE_H2=True, SCORED=scored, BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_K=bk, RELOAD_BOUNDS=E > 32, LOCKSTEP=False,
                         EXPERT_GROUPS=False, num_warps=4),
                    4, 1, types=types, production=False, gluon=True,
                    options=dict(maxnreg=wg._MAXNREG)))
        for epi, bufs, stages in GLUON_W2_DGRAD_SPLIT_CASES:  # the epilogue's partition
            picked = (epi, bufs) == (8, 1) and stages in (4, 5) and name != "smoke"
            for scored in (True, False) if picked else (True,):  # the layer's, the plain one
                cases.append(split_case(name, epi, bufs, stages, scored, picked))
    if "gpt-oss-120b" not in shapes:  # F = 2880: each row's last column tile partial
        cases += [split_case("gpt-oss-120b", 8, 1, 4, scored, True)
                  for scored in (True, False)]
    # the TMA producer in lockstep (W2DgradConfig.lockstep), as picked at deepseek-v3
    cases.append(split_case("deepseek-v3", 8, 1, 4, True, True, lockstep=True))
    # and in the expert-group order (W2DgradConfig.expert_groups), there and at qwen3-30b-a3b
    cases.append(split_case("deepseek-v3", 8, 1, 4, True, True, lockstep=True,
                            expert_groups=True))
    cases.append(split_case("qwen3-30b-a3b", 8, 1, 4, True, True, expert_groups=True))
    return cases


def gluon_w2_cases(shapes: tuple[str, ...] = ("dense-e32", "qwen3-30b-a3b")) -> list[BuildCase]:
    """The warp-specialised Gluon W2 forward (:mod:`distmoe.kernels.w2_forward.gluon`) at each
    shape, with an enable flag: the ping-pong 128 x 128 tile at ring depths 4 to 6 and the
    cooperative 128 x 256 tile at 3 and 4; and the same kernel as the W13 DGRAD (weights
    read N-major; ping-pong at 5 and 6 stages, cooperative at 4). Then both as picked at gpt-oss-120b, whose D (2880)
    leaves each row's last column tile partial, the W2 forward also with its producers in
    lockstep; the W13 DGRAD in lockstep at deepseek-v3, and both in lockstep in the
    expert-group order there. Production: no spill, no serialized wgmma."""
    from distmoe.kernels.base.config import next_power_of_2
    from distmoe.kernels.w2_forward import gluon as wg
    from distmoe.tools.bench.workloads import SHAPES

    if not wg.HAVE_GLUON:
        return []

    def case(name, bn, warps, stages, w13_dgrad=False, lockstep=False, expert_groups=False):
        s = SHAPES[name]
        D, F, E = s.hidden, s.ffn, s.num_experts
        depth = 2 * F if w13_dgrad else F
        types = {"a_desc": _gluon_desc(1024, depth, [128, 64]),
                 # W13 DGRAD: w13 viewed [E 2F, D], read N-major; W2: w2 viewed [E D, F]
                 "w_desc": (_gluon_desc(E * depth, D, [64, bn]) if w13_dgrad
                            else _gluon_desc(E * D, F, [bn, 64]))}
        return BuildCase(
            f"{name} {'W13 DGRAD' if w13_dgrad else 'W2 fwd'} gluon 128x{bn}"
            f"{' coop' if warps == 8 else ''} s{stages}"
            f"{' lockstep' if lockstep else ''}{' expert-groups' if expert_groups else ''}",
            wg._gluon_w2_kernel,
            dict(HIDDEN=D, FFN=depth, NUM_EXPERTS=E, EXPERTS_POW2=max(32, next_power_of_2(E)),
                 GROUP_M=8, STAGES=stages, HAS_ENABLE=not w13_dgrad,
                 BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, COOP=warps == 8,
                 B_K_MAJOR=not w13_dgrad, LOCKSTEP=lockstep, EXPERT_GROUPS=expert_groups,
                 num_warps=4),
            4, 1, types=types, production=True, gluon=True, options=dict(maxnreg=wg._MAXNREG))

    cases = []
    for name in shapes:
        for bn, warps, stages in ((128, 4, 4), (128, 4, 5), (128, 4, 6), (256, 8, 3),
                                  (256, 8, 4)):
            cases.append(case(name, bn, warps, stages))
        for bn, warps, stages in ((128, 4, 5), (128, 4, 6), (256, 8, 4)):
            cases.append(case(name, bn, warps, stages, w13_dgrad=True))
    if "gpt-oss-120b" not in shapes:
        cases += [case("gpt-oss-120b", 128, 4, 6), case("gpt-oss-120b", 128, 4, 6, w13_dgrad=True)]
    # the producers in lockstep (W2Config.lockstep), as the W2 forward picked at gpt-oss-120b
    cases.append(case("gpt-oss-120b", 128, 4, 6, lockstep=True))
    # and the W13 DGRAD's (W13DgradConfig.lockstep) at deepseek-v3's 5-stage ring
    cases.append(case("deepseek-v3", 128, 4, 5, w13_dgrad=True, lockstep=True))
    # the expert-group tile order (W2Config / W13DgradConfig.expert_groups) at 256 experts
    cases.append(case("deepseek-v3", 128, 4, 6, lockstep=True, expert_groups=True))
    cases.append(case("deepseek-v3", 128, 4, 5, w13_dgrad=True, lockstep=True,
                      expert_groups=True))
    return cases


def gluon_fused_cases(shapes: tuple[str, ...] = ("dense-e32", "qwen3-30b-a3b")) -> list[BuildCase]:
    """The fused W13 + W2 inference kernel (:mod:`distmoe.kernels.mega.gluon`): at each
    shape its default (ping-pong 128 x 64 W13 / 128 x 128 W2 tiles, 6 stages, lag 3, static
    schedule) and the cooperative tiles (128 x 128 / 128 x 256, 4 stages), static
    (production: no spill, no serialized wgmma); at ``qwen3-30b-a3b`` both with the tiles handed out
    at run time (build only: their producers spill 8-12 bytes)."""
    from distmoe.kernels.base.config import next_power_of_2
    from distmoe.kernels.mega import gluon as wf
    from distmoe.tools.bench.workloads import SHAPES

    if not wf.HAVE_GLUON:
        return []
    cases = []
    for name in shapes:
        s = SHAPES[name]
        D, F, E = s.hidden, s.ffn, s.num_experts
        for (bn, warps, stages), dyn in itertools.product(((64, 4, 6), (128, 8, 4)),
                                                          (False, True)):
            if dyn and name != "qwen3-30b-a3b":
                continue
            types = {"w13_desc": _gluon_desc(2 * E * F, D, [bn, 64]),
                     "w2_desc": _gluon_desc(E * D, F, [bn, 64]),
                     "h2_desc": _gluon_desc(1024, F, [128, 64])}
            cases.append(BuildCase(
                f"{'variant ' if dyn else ''}{name} W13+W2 fused gluon "
                f"{'coop' if warps == 8 else 'pp'} bn{bn} s{stages} lag3"
                f"{' dynamic' if dyn else ''}",
                wf._fused_kernel,
                dict(HIDDEN=D, FFN=F, NUM_EXPERTS=E, EXPERTS_POW2=max(32, next_power_of_2(E)),
                     GROUP_M=8, LAG=3, STAGES=stages, BLOCK_N=bn, DYNAMIC=dyn, IDS=wf._IDS,
                     PRODUCER_THREADS=wf._PRODUCER_THREADS, COOP=warps == 8, num_warps=4),
                4, 1, types=types, production=not dyn, gluon=True,
                options=dict(maxnreg=wf._MAXNREG)))
    return cases


def grouped_gemm_cases(shapes: tuple[str, ...] = ("dense-e32", "qwen3-30b-a3b"),
                       variants: bool = True) -> list[BuildCase]:
    """Production cases at each of ``shapes`` (EP=1 shape keys), then, with ``variants``,
    the other flag combinations at the ``qwen3-30b-a3b`` shape (module docstring)."""
    from distmoe.kernels.base.config import next_power_of_2
    from distmoe.kernels.w2_dgrad import triton as w2b
    from distmoe.kernels.w2_forward import triton as w2f
    from distmoe.kernels.w13_dgrad import triton as w13b
    from distmoe.kernels.w13_forward import triton as w13f
    from distmoe.kernels.wgrad import triton as wgt
    from distmoe.plan import rules
    from distmoe.tools.bench.workloads import SHAPES

    cases: list[BuildCase] = []

    def add(name, production, shape, *, w13=(), w2=(), w13d=(), w2d=(), wgrad=()):
        s = SHAPES[shape]
        D, F, E = s.hidden, s.ffn, s.num_experts
        hint = s.tokens * s.top_k // E
        ep2 = next_power_of_2(E)
        # persistent None: the heuristic's choice
        for host, persistent, train in w13:
            c = rules.w13_forward_config(hidden=D, ffn=F, rows_per_expert=hint,
                                              training=train)
            persistent = c.persistent if persistent is None else persistent
            cases.append(BuildCase(
                f"{name} W13 fwd host={host} persistent={persistent} training={train} "
                f"tma_epilogue={c.tma_epilogue and persistent}",
                w13f._gather_w13_swiglu_kernel,
                dict(NUM_EXPERTS=E, EXPERTS_POW2=ep2, HIDDEN=D, FFN=F, BLOCK_M=c.block_m,
                     BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, EVEN_K=True,
                     EVEN_N=True, PERSISTENT=persistent, HOST_DESC=host, WRITE_H1=train,
                     WRITE_X=train, DYN_OFFSETS=train, HAS_ENABLE=train,
                     TMA_STORE=c.tma_epilogue and persistent, HAS_ORDER=False),
                c.num_warps, c.num_stages,
                types={"w13": _desc(1, c.block_n, c.block_k)} if host else {},
                production=production))
        for host, persistent in w2:
            c = rules.w2_forward_config(hidden=D, ffn=F, rows_per_expert=hint)
            persistent = c.persistent if persistent is None else persistent
            descs = ({"h2": _desc(c.block_m, c.block_k), "w2": _desc(1, c.block_n, c.block_k)}
                     if host else {})
            cases.append(BuildCase(
                f"{name} W2 fwd host={host} persistent={persistent}", w2f._w2_scatter_kernel,
                dict(NUM_EXPERTS=E, EXPERTS_POW2=ep2, HIDDEN=D, FFN=F, BLOCK_M=c.block_m,
                     BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, EVEN_N=True,
                     PERSISTENT=persistent, HOST_DESC=host, HAS_ENABLE=True),
                c.num_warps, c.num_stages, types=descs, production=production))
        for host, persistent in w13d:
            c = rules.w13_dgrad_config(hidden=D, ffn=F, rows_per_expert=hint)
            persistent = c.persistent if persistent is None else persistent
            c = c.with_grid(persistent)
            descs = ({"grad_h1": _desc(c.block_m, c.block_k),
                      "w13": _desc(1, c.block_k, c.block_n)} if host else {})
            if host and c.pair_tails:
                descs["grad_h1_half"] = _desc(c.block_m // 2, c.block_k)
                descs["w13_half"] = _desc(1, c.block_k, c.block_n // 2)
            cases.append(BuildCase(
                f"{name} W13 DGRAD host={host} persistent={persistent} "
                f"pair_tails={c.pair_tails} dynamic={c.dynamic}",
                w13b._w13_dgrad_scatter_kernel,
                dict(HIDDEN=D, FFN=F, NUM_EXPERTS=E, EXPERTS_POW2=ep2, HOST_DESC=host,
                     PERSISTENT=persistent, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                     BLOCK_K=c.block_k, GROUP_M=c.group_m, PAIR_TAILS=c.pair_tails,
                     DYNAMIC=c.dynamic),
                c.num_warps, c.num_stages, types=descs, production=production))
        for host, persistent, gather_in_loop, scored in w2d:
            c = rules.w2_dgrad_config(hidden=D, ffn=F, rows_per_expert=hint)
            persistent = c.persistent if persistent is None else persistent
            descs = {}
            if host:
                descs["w2"] = _desc(1, c.block_k, c.block_n)
                if not gather_in_loop:
                    descs["grad_h3_rows"] = _desc(c.block_m, c.block_k)
            cases.append(BuildCase(
                f"{name} W2 DGRAD host={host} persistent={persistent} "
                f"gather_in_loop={gather_in_loop} scored={scored}",
                w2b._w2_dgrad_swiglu_kernel,
                dict(HIDDEN=D, FFN=F, NUM_EXPERTS=E, EXPERTS_POW2=ep2,
                     GATHER_IN_LOOP=gather_in_loop, STORE_H2=True, SCORED=scored,
                     HOST_DESC=host,
                     H1_OFFSET=True, PERSISTENT=persistent, BLOCK_M=c.block_m,
                     BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m),
                c.num_warps, c.num_stages, types=descs, production=production))
        for kind, host, split_rows, overwrite, *gather in wgrad:
            gather = bool(gather and gather[0])  # W13's x rows through the address table
            P, Q = (2 * F, D) if kind == "W13" else (D, F)
            c = rules.wgrad_config(out_rows=P, out_cols=Q, rows_per_expert=hint)
            b_offset = kind == "W13"  # the layer passes W13's x at a device offset
            tma_store = overwrite
            descs = {}
            if host:
                descs["a"] = _desc(c.block_k, c.block_out_m)
                if not b_offset:
                    descs["b"] = _desc(c.block_k, c.block_out_n)
                if tma_store:
                    descs["out_desc"] = _desc(1, c.block_out_m, c.block_out_n)
            if not (host and tma_store):
                descs["out_desc"] = "*i32"  # a placeholder tensor
            if not overwrite:
                descs["out_ptr"] = "*fp32"  # accumulating: fp32 .grad
            cases.append(BuildCase(
                f"{name} {kind} WGRAD host={host} split_rows={split_rows} "
                f"overwrite={overwrite}{' x_rows' if gather else ''}",
                wgt._grouped_wgrad_kernel,
                dict(P=P, Q=Q, NUM_EXPERTS=E, SPLIT_ROWS=split_rows, OVERWRITE=overwrite,
                     TMA_STORE=tma_store, INTERPRETED=False, HOST_DESC=host,
                     B_OFFSET=b_offset, GATHER_B=gather, BLOCK_K=c.block_k,
                     BLOCK_P=c.block_out_m, BLOCK_Q=c.block_out_n),
                c.num_warps, c.num_stages,
                types=descs if gather else descs | _NO_ADDRESS_TABLE, production=production))

    for shape in shapes:
        # what the training layer launches (host descriptors: the GemmConfig default)
        add(shape, True, shape, w13=[(True, None, True), (True, None, False)], w2=[(True, None)],
            w13d=[(True, None)], w2d=[(True, None, False, False)],
            wgrad=[("W13", True, 1, True), ("W2", True, 1, True)])
    if variants:
        add("variant", False, "qwen3-30b-a3b",
            w13=[(False, True, True), (True, False, False), (False, False, False)],
            w2=[(False, True), (True, False)],
            w13d=[(False, False), (True, False)],
            # scored: 4 bytes of spills at qwen3-30b-a3b (on Hopper the layer runs the Gluon kernel)
            w2d=[(False, True, False, False), (True, True, True, False),
                 (False, False, True, False), (True, None, False, True)],
            wgrad=[("W13", False, 1, True), ("W2", True, 3, False), ("W2", False, 1, False),
                   ("W13", True, 1, True, True)])
    return cases


def other_kernel_cases() -> list[BuildCase]:
    """Every other kernel of the library, each flag value its launcher passes (``qwen3-30b-a3b``
    shape: D=2048, E=128, K=8; EP=2 where a kernel takes it). Build only."""
    from distmoe.kernels.movement import call_counters, slot_cursor
    from distmoe.kernels.movement import combine as comb
    from distmoe.kernels.movement import offset_copy as oc
    from distmoe.kernels.movement import publish_ids as pub
    from distmoe.kernels.movement import pull_tokens as pull
    from distmoe.kernels.movement import regather_rows as regather
    from distmoe.kernels.movement import route_grad as rg
    from distmoe.kernels.w2_dgrad import triton as w2b
    from distmoe.kernels.w13_forward import phases
    from distmoe.plan import rules
    from distmoe.routing import fused
    from distmoe.runtime import barrier

    D, E, K, EP, T = 2048, 128, 8, 2, 4096
    cases: list[BuildCase] = []
    cc = rules.combine_config(hidden=D)
    for rows_addr in (False, True):
        cases.append(BuildCase(
            f"combine rows_addr={rows_addr}", comb._combine_kernel,
            dict(TOP_K=K, HIDDEN=D, BLOCK_T=cc.block_t, BLOCK_D=cc.block_d,
                 ROWS_ADDR=rows_addr),
            cc.num_warps, 1,
            types={"expert_ids_ptr": "*i64", "scores_ptr": "*fp32", "num_tokens": "i32",
                   "rows_ptr": "*i64" if rows_addr else "*bf16"}))
    rc = rg.RouteGradConfig.for_widths(hidden=D)
    for h3_addr, in_place, push in ((False, False, False), (True, False, False),
                                    (False, True, False), (True, False, True)):
        cases.append(BuildCase(
            f"route_grads h3_addr={h3_addr} in_place={in_place} push={push}",
            rg._route_grads_kernel,
            dict(TOP_K=K, HIDDEN=D, BLOCK_R=rc.block_rows, BLOCK_D=rc.block_d, H3_ADDR=h3_addr,
                 IN_PLACE=in_place, PUSH=push),
            rc.num_warps, 1,
            types={"h3_ptr": "*i64" if h3_addr else "*bf16", "expert_ids_ptr": "*i64",
                   "scores_ptr": "*fp32", "grad_scores_ptr": "*fp32", "num_routes": "i32",
                   "dest_rows_ptr": "*i32", "dest_bases_ptr": "*i64",
                   "experts_per_rank": "i32"}))
    cases.append(BuildCase(
        "push_route_grads", rg._push_route_grads_kernel,
        dict(TOP_K=K, HIDDEN=D, BLOCK_R=rc.block_rows, BLOCK_D=rc.block_d), rc.num_warps, 1,
        types={"expert_ids_ptr": "*i64", "scores_ptr": "*fp32", "score_rows_ptr": "*fp32",
               "dest_rows_ptr": "*i32", "dest_bases_ptr": "*i64", "num_routes": "i32",
               "experts_per_rank": "i32"}))
    for parts in (0, 6):  # F = 768 in 128-column tiles
        cases.append(BuildCase(
            f"reduce_routes score_parts={parts}", rg._reduce_routes_kernel,
            dict(TOP_K=K, HIDDEN=D, BLOCK_T=rc.block_rows, BLOCK_D=rc.block_d,
                 SCORE_PARTS=parts, PARTS_POW2=max(1, 1 << (parts - 1).bit_length())),
            rc.num_warps, 1,
            types={"expert_ids_ptr": "*i64", "num_tokens": "i32", "score_rows_ptr": "*fp32",
                   "grad_scores_ptr": "*fp32"}))
    cases.append(BuildCase(
        "gather_rows", w2b._gather_rows_kernel,
        dict(WIDTH=D, NUM_EXPERTS=E, EXPERTS_POW2=E, BLOCK_ROWS=w2b._GATHER_BLOCK_ROWS,
             BLOCK_COLS=min(512, D)), 4, 1,
        types={"row_ptrs_ptr": "*i64"}))
    for src_off, dst_off in ((True, False), (False, True), (True, True)):
        cases.append(BuildCase(
            f"offset_copy src_off={src_off} dst_off={dst_off}", oc._offset_copy_kernel,
            dict(HAS_SRC_OFF=src_off, HAS_DST_OFF=dst_off, BLOCK=oc._BLOCK), 4, 1,
            types={"src_off_ptr": "*i64", "dst_off_ptr": "*i64", "numel": "i32"}))
    for ids_type in ("*i64", "*i32", "*u8"):  # the forward's publish of T and the ids
        cases.append(BuildCase(
            f"publish_ids ids={ids_type[1:]}", pub._publish_ids_kernel,
            dict(BLOCK=pub._BLOCK), 4, 1,
            types={"ids_ptr": ids_type, "out_ptr": "*i16", "header_ptr": "*i32",
                   "numel": "i32", "tokens": "i32", "num_experts": "i32"}))
    # the flagged pull (forward and replay), the table after the copy-engine pull, and
    # EP = 1's table that reads x in place
    # (with the block flags of W13's two launches, distmoe.kernels.w13_forward.phases)
    for enable, mark, own, ep, blocks in ((False, True, False, EP, False),
                                          (True, True, False, EP, False),
                                          (False, False, False, EP, True),
                                          (False, False, True, 1, False)):
        cases.append(BuildCase(
            f"mark_tokens EP={ep} enable={enable} mark={mark} own={own} blocks={blocks}",
            pull._mark_tokens_kernel,
            dict(T_MAX=T, EP=ep, ROW_BYTES=2 * D, BLOCK_R=pull._BLOCK_R, HAS_ENABLE=enable,
                 MARK=mark, OWN=own, BLOCK_FLAGS=blocks),
            4, 1,
            types={"src_ptrs_ptr": "*i64", "bases_ptr": "*i64", "out_ptrs_ptr": "*i64",
                   "flags_ptr": "*i8", "block_flags_ptr": "*i8", "dst_base": "i64",
                   "own_base": "i64", "r_cap": "i32", "rank": "i32"}))
    cases.append(BuildCase(
        "call counters", call_counters._count_call_kernel, dict(EP=EP), 1, 1,
        types={"counters_ptr": "*i64", "recv_ptr": "*i64", "dropped_ptr": "*i64",
               "invalid_ptr": "*i64", "header_bases_ptr": "*i64", "tokens": "i32"}))
    cases.append(BuildCase(
        "w13 phase order", phases._phase_order_kernel,
        dict(NUM_EXPERTS=E // EP, EXPERTS_POW2=E // EP, BLOCK_M=128, CHUNK=phases._CHUNK), 4, 1,
        types={"peer_ptr": "*i8", "starts_ptr": "*i8", "first": "i32"}))
    for enable in (False, True):
        cases.append(BuildCase(
            f"pull_tokens enable={enable}", pull._pull_tokens_kernel,
            dict(T_MAX=T, EP=EP, ROW_ELEMS=D, COPY_ELEMS=D if enable else D // 2,
                 BLOCK_T=pull._BLOCK_T, BLOCK_D=pull._BLOCK_D, HAS_ENABLE=enable),
            4, 1, types={"bases_ptr": "*i64", "flags_ptr": "*i8"}))
    EB = max(16, 1 << (E + 2 - 1).bit_length())
    EPB = max(2, EP)
    E_LOCAL = E // EP
    common = {"ids_ptr": "*i64", "dispatch_bases_ptr": "*i64", "combine_bases_ptr": "*i64",
              "scratch_ptr": "*i32", "rows_per_expert_ptr": "*i32", "executed_ep_ptr": "*i64",
              "tables_ptr": "*i64", "route_of_row_ptr": "*i64", "counters_ptr": "*i64",
              "executed_tk_ptr": "*i1", "N": "i32", "T": "i32", "RANK": "i32",
              "RECEIVE_BOUND": "i32", "CAP": "i32", "ROW_BYTES": "i32"}
    for training in (False, True):
        cases.append(BuildCase(
            f"routing_tables (one program) training={training}", fused._routing_tables_kernel,
            dict(K=K, E=E, E_LOCAL=E_LOCAL, EP=EP, ROW_BLOCK=128, NP=1024, EB=EB, EPB=EPB,
                 TRAINING=training), 4, 1, types=common))
        cases.append(BuildCase(
            f"blocked_routes training={training}", fused._blocked_routes_kernel,
            dict(K=K, E=E, E_LOCAL=E_LOCAL, BLOCK=fused.BLOCKED_ROUTES_PER_PROGRAM, EB=EB,
                 TRAINING=training), 4, 1,
            types={**common, "hist_ptr": "*i32", "incl_ptr": "*i32", "rank_ptr": "*i32"}))
    cases.append(BuildCase(
        "block_ranks", fused._block_ranks_kernel,
        dict(E=E, BLOCK=fused.BLOCKED_ROUTES_PER_PROGRAM, EB=EB), 4, 1,
        types={"ids_ptr": "*i64", "hist_ptr": "*i32", "scratch_ptr": "*i32",
               "rank_ptr": "*i32", "N": "i32"}))
    cases.append(BuildCase(
        "block_prefix", fused._block_prefix_kernel,
        dict(EB=EB, COLS=fused._PREFIX_COLS, ROWS=fused._PREFIX_ROWS), 4, 1,
        types={"hist_ptr": "*i32", "incl_ptr": "*i32", "NB": "i32"}))
    cases.append(BuildCase(
        "blocked_layout", fused._blocked_layout_kernel,
        dict(E=E, E_LOCAL=E_LOCAL, EP=EP, ROW_BLOCK=128, EB=EB, EPB=EPB), 4, 1,
        types={"counts_ptr": "*i32", "scratch_ptr": "*i32", "rows_per_expert_ptr": "*i32",
               "executed_ep_ptr": "*i64", "RANK": "i32", "RECEIVE_BOUND": "i32"}))
    i64 = ("num_slots", "max_layers", "slot_bytes", "input_bytes", "kept_x_bytes", "h3_bytes",
           "combine_address", "elements_address", "replay_h1_offset", "replay_x_offset",
           "rows_origin")
    cases.append(BuildCase(
        "begin_layer (slot cursor)", slot_cursor._begin_layer_kernel,
        dict(X_ROW_BYTES=2 * D, H1_ROW_BYTES=4 * 768, MODE=2, EP=EP, EP_POW2=EP), 1, 1,
        types={**{n: "*i64" for n in ("rows_ptr", "cursors_ptr", "selection_ptr", "depth_ptr",
                                      "errors_ptr", "where_ptr", "before_ptr", "offsets_ptr",
                                      "backward_ptr", "act_bases_ptr", "combine_bases_ptr",
                                      "deltas_ptr")},
               "replay_ptr": "*i1", "flags_ptr": "*i32", "rank": "i32",
               **{n: "i64" for n in i64}}))
    cases.append(BuildCase(
        "end_layer (slot cursor)", slot_cursor._end_layer_kernel, dict(EP=EP, EP_POW2=EP), 1, 1,
        types={n: "*i64" for n in ("where_ptr", "before_ptr", "cursors_ptr", "depth_ptr",
                                   "errors_ptr")}))
    cases.append(BuildCase(
        "regather_rows", regather._regather_kernel,
        dict(HIDDEN=D, NUM_EXPERTS=E // EP, EXPERTS_POW2=E // EP, BLOCK_M=32,
             BLOCK_D=regather._BLOCK_D, HAS_ENABLE=True), 4, 1,
        types={"gather_ptrs_ptr": "*i64", "padded_offsets_ptr": "*i32",
               "row_offsets_ptr": "*i32", "out_ptr": "*bf16", "enable_ptr": "*i32"}))
    for timed in (False, True):
        cases.append(BuildCase(
            f"device_barrier timed={timed}", barrier._device_barrier_kernel,
            dict(WORLD=EP, TIMED=timed), 1, 1,
            types={"signal_bases_ptr": "*i64", "epoch_ptr": "*i64", "rank": "i32",
                   "fail_addr": "i64", "timeout_ns": "i64"}))
    return cases


def gluon_scaled_cases(shapes: tuple, num_experts: int) -> list[BuildCase]:
    """The warp-specialised block-scaled GEMM (:mod:`distmoe.kernels.scaled.gluon`) for both
    128-group layouts at each ``(name, K, N, swiglu)`` of ``shapes``; a spill is a failure."""
    from distmoe.kernels.base.config import next_power_of_2
    from distmoe.kernels.scaled import gluon as sg
    from distmoe.kernels.scaled import triton as scaled
    from distmoe.kernels.scaled import wgrad_gluon as wg

    cases = []
    for layout in (scaled.MXFP8_REBASED, scaled.FP8_BLOCK):
        scale_type = "*fp32" if layout.fp32 else "*u8"
        # the FP8 weight gradients (token-axis operands): W13's [2F, D] and W2's [D, F]
        d, f = shapes[0][1], shapes[0][2] // 2
        # (one per layout: the two differ only in the widths and the output mode)
        for name, m, n, acc in ((("W13", 2 * f, d, False),) if not layout.fp32 else
                                (("W2", d, f, True),)):
            types = {"a_desc": _gluon_desc(m, 8192, [128, 128], fp8=True),
                     "b_desc": _gluon_desc(n, 8192, [128, 128], fp8=True),
                     "sa_ptr": scale_type, "sb_ptr": scale_type,
                     "out_ptr": "*fp32" if acc else "*bf16", "R_CAP": "i32"}
            cases.append(BuildCase(
                f"scaled {layout.name} {name} WGRAD gluon{' accumulate' if acc else ''}",
                wg._gluon_scaled_wgrad_kernel,
                dict(M=m, N=n, NUM_EXPERTS=num_experts, STAGES=5, SCALE_FP32=layout.fp32,
                     ACCUMULATE=acc),
                4, 1, types=types, production=True, gluon=True,
                options=dict(maxnreg=wg._MAXNREG)))
        for name, k, n, swiglu in shapes:
            out_n = n // 2 if swiglu else n
            types = {"a_desc": _gluon_desc(4096, k, [128, 128], fp8=True),
                     "b_desc": _gluon_desc(num_experts * n, k, [64 if swiglu else 128, 128],
                                           fp8=True),
                     "sa_ptr": scale_type, "sb_ptr": scale_type, "scatter_ptr": "*i64"}
            cases.append(BuildCase(
                f"scaled {layout.name} {name} gluon", sg._gluon_scaled_kernel,
                dict(K=k, N=n, OUT_N=out_n, NUM_EXPERTS=num_experts,
                     EXPERTS_POW2=max(32, next_power_of_2(num_experts)), GROUP_M=8, STAGES=5,
                     SWIGLU=swiglu, SB_ROWS=layout.b_rows, SCALE_FP32=layout.fp32,
                     SCATTER=name == "W2"),
                4, 1, types=types, production=True, gluon=True,
                options=dict(maxnreg=sg._MAXNREG)))
    return cases


def lowp_kernel_cases() -> list[BuildCase]:
    """The low-precision kernels (``qwen3-30b-a3b`` widths: D=2048, F=768, E=64 local): the
    block-scaled grouped GEMM in each scale layout (exact MXFP8, MXFP8 rebased onto 128-wide
    groups, block FP8), W13 + SwiGLU and W2, at their default configs; the NVFP4-weight GEMM;
    the MXFP8 (plain and rebased) and block-FP8 quantisers; the rowwise byte PUT and the
    scaled combine. Build only (their speed is the bench's)."""
    from distmoe.kernels.base.config import next_power_of_2
    from distmoe.kernels.movement import rowwise_get, rowwise_put
    from distmoe.kernels.scaled import ScaledGemmConfig, nvfp4, nvfp4_weight_config, swiglu_quant
    from distmoe.kernels.scaled import triton as scaled
    from distmoe.plan import rules
    from distmoe.quant import fp8_block, mxfp8

    D, F, E, K = 2048, 768, 64, 8
    cases: list[BuildCase] = []
    shapes = (("W13", D, 2 * F, True), ("W2", F, D, False),
              # FP8 training (distmoe.ops.lowp_train): W13 storing h1, the two input-gradient
              # GEMMs
              ("W13 h1", D, 2 * F, False), ("W2 dgrad", D, F, False),
              ("W13 dgrad", 2 * F, D, False))
    for layout in (scaled.MXFP8, scaled.MXFP8_REBASED, scaled.FP8_BLOCK):
        scale_type = "*fp32" if layout.fp32 else "*u8"
        for name, k, n, swiglu in shapes:
            cfg = ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu, k_group=layout.k_group)
            out_n = n // 2 if swiglu else n
            cases.append(BuildCase(
                f"scaled {layout.name} {name}", scaled._mxfp8_grouped_mm_kernel,
                dict(NUM_EXPERTS=E, EXPERTS_POW2=next_power_of_2(E), K=k, N=n, OUT_N=out_n,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0,
                     EVEN_N=out_n % cfg.block_n == 0, SWIGLU=swiglu, INTERPRET=False,
                     K_GROUP=layout.k_group, SB_ROWS=layout.b_rows, SCALE_FP32=layout.fp32,
                     SCATTER=name == "W2"),
                cfg.num_warps, cfg.num_stages,
                types={"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": scale_type,
                       "sb_ptr": scale_type, "scatter_ptr": "*i64"}))
    cases += gluon_scaled_cases(shapes[:2], E)  # W13 + SwiGLU, W2 with its scatter epilogue
    from distmoe.kernels.scaled import token_quant, wgrad
    for fp32 in (False, True):
        scale_type = "*fp32" if fp32 else "*u8"
        cases.append(BuildCase(
            f"token quantise fp8_block={fp32}", token_quant._token_quant_kernel,
            dict(C=D, NUM_EXPERTS=E, EXPERTS_POW2=E, BLOCK_C=64, GATHER=fp32,
                 BLOCK_FP8=fp32), 8, 1,
            types={"qt_ptr": "*u8", "st_ptr": scale_type, "R_CAP": "i32",
                   "rows_ptr": "*bf16"}))
    for fp32 in (True,):  # the fallback of the Gluon FP8 WGRAD
        scale_type = "*fp32"
        cases.append(BuildCase(
            f"scaled WGRAD triton fp32_scales={fp32}", wgrad._scaled_wgrad_kernel,
            dict(M=2 * F, N=D, NUM_EXPERTS=E, BLOCK_M=128, BLOCK_N=128, INTERPRET=False,
                 SCALE_FP32=fp32, ACCUMULATE=fp32),
            8, 3, types={"at_ptr": "*fp8e4nv", "bt_ptr": "*fp8e4nv", "sa_ptr": scale_type,
                         "sb_ptr": scale_type, "out_ptr": "*fp32" if fp32 else "*bf16",
                         "R_CAP": "i32"}))
    from distmoe.quant import dequant
    for fmt, (group, _) in dequant.DEQUANT_FORMATS.items():
        cases.append(BuildCase(
            f"dequantise rows {fmt}", dequant._dequant_rows_kernel,
            dict(COLS=D, GROUP=group, E8M0=fmt != "fp8_block", BLOCK_R=32, BLOCK_C=256), 4, 1,
            types={"q_ptr": "*u8", "s_ptr": "*fp32" if fmt == "fp8_block" else "*u8",
                   "rows": "i32"}))
    from distmoe.kernels.scaled import gather_quant
    for fmt, (unit, blocks) in (("mxfp8", (32, 8)), ("mxfp8_rebased", (32, 8)),
                                ("fp8_block", (128, 2))):
        cases.append(BuildCase(
            f"gather quantise {fmt}", gather_quant._gather_quant_kernel,
            dict(HIDDEN=D, NUM_EXPERTS=E, EXPERTS_POW2=E, BLOCK_M=32, UNIT=unit, BLOCKS=blocks,
                 REBASE=fmt == "mxfp8_rebased", BLOCK_FP8=fmt == "fp8_block"), 8, 1,
            types={"q_ptr": "*u8", "s_ptr": "*fp32" if fmt == "fp8_block" else "*u8"}))
    for (name, k, n, swiglu), mx in itertools.product(shapes[:2], (False, True)):
        cfg = nvfp4_weight_config(k=k, n=n, swiglu=swiglu)
        out_n = n // 2 if swiglu else n
        # W13 of an nvfp4 layer at EP > 1 reads the packed rows' global scales too
        for row_scale in (False, True) if swiglu and not mx else (False,):
            cases.append(BuildCase(
                f"{'mxfp4' if mx else 'nvfp4'} weights {name}"
                + (" row scale" if row_scale else ""), nvfp4._nvfp4_weight_grouped_mm_kernel,
                dict(NUM_EXPERTS=E, EXPERTS_POW2=next_power_of_2(E), K=k, N=n, OUT_N=out_n,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, SWIGLU=swiglu,
                     SCALE_GROUP=32 if mx else 16, E8M0=mx, HAS_GLOBAL=not mx,
                     HAS_ROW_SCALE=row_scale, SWAP_AB=False),
                cfg.num_warps, cfg.num_stages,
                types={"b_ptr": "*u8", "sb_ptr": "*u8", "gs_ptr": "*fp32", "rs_ptr": "*fp32"}))
        if not mx:  # config.interleave_k=False: a dot per K parity, strided activation loads
            cases.append(BuildCase(
                f"nvfp4 weights split K {name}", nvfp4._nvfp4_weight_grouped_mm_kernel,
                dict(NUM_EXPERTS=E, EXPERTS_POW2=next_power_of_2(E), K=k, N=n, OUT_N=out_n,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, SWIGLU=swiglu,
                     SCALE_GROUP=16, E8M0=False, HAS_GLOBAL=True, HAS_ROW_SCALE=False,
                     SWAP_AB=False, INTERLEAVE_K=False),
                cfg.num_warps, cfg.num_stages,
                types={"b_ptr": "*u8", "sb_ptr": "*u8", "gs_ptr": "*fp32", "rs_ptr": "*fp32"}))
        # the transposed tile (config.swap_ab: decoded weights as the dot's first operand)
        # as the plan picks it at decode
        swap = rules.fp4_weight_gemm(k=k, n=n, swiglu=swiglu, block_m=128, rows_per_expert=1,
                                     device_class="h100")
        assert swap.swap_ab, swap
        cases.append(BuildCase(
            f"{'mxfp4' if mx else 'nvfp4'} weights swapped {name}",
            nvfp4._nvfp4_weight_grouped_mm_kernel,
            dict(NUM_EXPERTS=E, EXPERTS_POW2=next_power_of_2(E), K=k, N=n, OUT_N=out_n,
                 BLOCK_M=swap.block_m, BLOCK_N=swap.block_n, BLOCK_K=swap.block_k,
                 GROUP_M=swap.group_m, EVEN_K=k % swap.block_k == 0, SWIGLU=swiglu,
                 SCALE_GROUP=32 if mx else 16, E8M0=mx, HAS_GLOBAL=not mx,
                 HAS_ROW_SCALE=False, SWAP_AB=True),
            swap.num_warps, swap.num_stages,
            types={"b_ptr": "*u8", "sb_ptr": "*u8", "gs_ptr": "*fp32", "rs_ptr": "*fp32"}))
        # the same weights on FP8 operands (1 x 128 FP8 rows, E4M3-expanded weights)
        cfg = nvfp4.fp4_weight_fp8_config(k=k, n=n, swiglu=swiglu)
        cases.append(BuildCase(
            f"{'mxfp4' if mx else 'nvfp4'} weights fp8 operands {name}",
            nvfp4._nvfp4_weight_grouped_mm_kernel,
            dict(NUM_EXPERTS=E, EXPERTS_POW2=next_power_of_2(E), K=k, N=n, OUT_N=out_n,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 GROUP_M=cfg.group_m, EVEN_K=True, SWIGLU=swiglu,
                 SCALE_GROUP=32 if mx else 16, E8M0=mx, HAS_GLOBAL=not mx,
                 HAS_ROW_SCALE=False, SWAP_AB=False, FP8_A=True, INTERPRET=False),
            cfg.num_warps, cfg.num_stages,
            types={"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*u8", "sb_ptr": "*u8",
                   "gs_ptr": "*fp32", "rs_ptr": "*fp32"}))
    from distmoe.kernels.scaled import nvfp4_rows
    _, global_at, _ = nvfp4_rows.nvfp4_row_layout(D)
    cases.append(BuildCase(
        "gather nvfp4 rows", nvfp4_rows._gather_nvfp4_kernel,
        dict(HIDDEN=D, BLOCK_B=nvfp4_rows._BLOCK_BYTES, GLOBAL_AT=global_at, NUM_EXPERTS=E,
             EXPERTS_POW2=next_power_of_2(E), BLOCK_M=nvfp4_rows._BLOCK_ROWS), 4, 1,
        types={"gather_ptrs_ptr": "*i64", "out_ptr": "*bf16", "scale_ptr": "*fp32"}))
    quant_types = {"q_ptr": "*u8", "rows": "i32", "num_groups": "i32"}
    for rebase in (False, True):
        cases.append(BuildCase(
            f"mxfp8 quantise rebase={rebase}", mxfp8._mxfp8_quantize_kernel,
            dict(BLOCK_R=32, GROUPS=4, REBASE=rebase), 4, 1,
            types={**quant_types, "x_ptr": "*bf16", "s_ptr": "*u8"}))
    cases.append(BuildCase(
        "fp8_block quantise", fp8_block._fp8_block_quantize_kernel,
        dict(BLOCK_R=32, GROUPS=1), 4, 1,
        types={**quant_types, "x_ptr": "*bf16", "s_ptr": "*fp32"}))
    for precision, block, stype in (("mxfp8", 32, "*u8"), ("mxfp8_rebased", 128, "*u8"),
                                    ("fp8_block", 128, "*fp32")):
        for backward in (False, True):
            cases.append(BuildCase(
                f"{precision} swiglu quantise backward={backward}",
                swiglu_quant._swiglu_quant_kernel,
                dict(F=F, B=block, FP32_SCALES=precision == "fp8_block",
                     REBASE=precision == "mxfp8_rebased", BACKWARD=backward,
                     STORE_H2=backward, BLOCK_R=32 if block == 32 else 8), 4, 1,
                types={"h1_ptr": "*bf16", "gh2_ptr": "*bf16", "out_ptr": "*bf16",
                       "q_ptr": "*u8", "s_ptr": stype, "h2_ptr": "*bf16", "rows": "i32"}))
    rc = rowwise_put.RowwiseConfig.for_widths(hidden=D)
    route_types = {"ranks_ptr": "*i64", "rows_ptr": "*i64", "bases_ptr": "*i64",
                   "bad_ptr": "*i64", "num_routes": "i32", "world": "i32", "num_rows": "i32"}
    cases.append(BuildCase(
        "rowwise put bytes", rowwise_put._rowwise_put_kernel,
        dict(TOP_K=K, HIDDEN=D, BLOCK_R=rc.block_r, BLOCK_D=rc.block_d, WEIGHTED=False,
             COUNT=True, BYTES=True), rc.num_warps, 1,
        types={**route_types, "x_ptr": "*u8", "probs_ptr": "*fp32"}))
    cc = rules.combine_config(hidden=D)
    for weighted, keep in ((False, False), (True, True)):
        cases.append(BuildCase(
            f"rowwise combine scaled weighted={weighted} keep={keep}",
            rowwise_get._rowwise_combine_get_scaled_kernel,
            dict(TOP_K=K, HIDDEN=D, BLOCK_T=cc.block_t, BLOCK_D=cc.block_d,
                 WEIGHTED=weighted, KEEP=keep, COUNT=True), cc.num_warps, 1,
            types={**route_types, "q_bases_ptr": "*i64", "s_bases_ptr": "*i64",
                   "probs_ptr": "*fp32", "y_ptr": "*bf16", "kept_ptr": "*bf16",
                   "num_tokens": "i32"}))
    return cases
