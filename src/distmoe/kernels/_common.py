"""Helpers shared by the forward expert kernels (W13 gather + SwiGLU, W2 scatter, combine).

* :class:`GemmConfig`: the frozen launch configuration of a grouped GEMM; each GEMM module
  subclasses it (``W13Config``, ``W2Config``) with its own ``from_heuristic`` / ``all_configs``.
* :func:`ensure_tma_allocator`: device-side TMA descriptors (``tl.make_tensor_descriptor``)
  need a global scratch allocator; this installs one that allocates a torch tensor.
* Input validation helpers that raise ``TypeError`` / ``ValueError`` naming the argument.
* Row-address helpers for the plain-PyTorch references: kernels receive absolute byte
  addresses of bf16 rows (rows of this process's tensors or of peers' buffers mapped into this
  address space); :func:`rows_at` and :func:`write_rows_at` turn those addresses back into
  (tensor, row) pairs so a reference can read and write the same rows.
* Triton helpers used by both GEMM kernels: the expert of a row tile (:func:`tile_expert`) and
  the group-M tile swizzle (:func:`swizzle_tile`).

Row layouts (the contract of every grouped kernel, forward and backward):

* **padded rows**, the tile schedule: ``R_cap`` rows, a multiple of ``block_m``;
  ``padded_offsets`` int32 ``[E_local + 1]`` on the device; local expert ``e`` owns rows
  ``[padded_offsets[e], padded_offsets[e+1])``, each segment a multiple of ``block_m``; rows
  at or beyond ``padded_offsets[E_local]`` are idle. Pointer tables (gather / scatter
  addresses) are indexed by padded row.
* **activation rows**, compact, what activation tensors hold: ``row_offsets`` int32
  ``[E_local + 1]``; expert ``e`` has ``n_e = row_offsets[e+1] - row_offsets[e]`` live rows;
  padded row ``padded_offsets[e] + j`` is live iff ``j < n_e`` and is activation row
  ``row_offsets[e] + j``. Padding rows are never stored and never contribute to a live output.

Grids are sized from ``R_cap`` only, so launches never read routed counts on the host (no
synchronisation, CUDA-graph safe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.interpreter import interpreter_active

# TMA: every stride but the last and every base address must be a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16
# Programs of a persistent grid when kernels run on the CPU interpreter: small, so that tests
# cover programs that walk several tiles.
_INTERPRETER_NUM_SMS = 3


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Launch configuration of one grouped GEMM (frozen; choose it from shapes only).

    Attributes:
        block_m: rows per tile. Must equal the padding multiple of the expert segments
            (the routing layer pads every expert to a multiple of it); power of two, 16-256.
        block_n: output columns per tile (for W13: per half, i.e. gate and up each get
            ``block_n`` columns); power of two, 16-256.
        block_k: reduction step; power of two, 16-256 (64 = one 128-byte bf16 TMA row).
        num_warps: 4 or 8 (one or two Hopper warpgroups).
        num_stages: software-pipeline depth of the K loop (>= 1).
        group_m: row tiles per group of the group-M swizzle (L2 reuse of weight tiles), >= 1.
        persistent: one program per SM walking the live tiles (device-side tile count), instead
            of one program per tile of the ``R_cap`` bound with idle programs exiting at once.
        host_descriptors: the TMA descriptors are encoded on the host at launch and passed as
            kernel parameters (no device work); False builds them in every program
            (``tl.make_tensor_descriptor``: 128 bytes of scratch and a tensormap fence each,
            through the allocator that :func:`ensure_tma_allocator` installs).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    persistent: bool = False
    host_descriptors: bool = True

    # bf16 B tiles loaded per K step (W13 loads gate and up: 2).
    _B_TILES = 1
    # fp32 accumulators per tile (W13: gate and up).
    _ACCUMULATORS = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if not (_is_power_of_2(value) and 16 <= value <= 256):
                raise ValueError(f"{name} ({value}) must be a power of two in [16, 256]")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps ({self.num_warps}) must be 4 or 8")
        for name in ("num_stages", "group_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an int >= 1")
        for field in dataclasses.fields(self):  # every bool option, the subclasses' too
            if field.type in ("bool", bool):
                value = getattr(self, field.name)
                if not isinstance(value, bool):
                    raise TypeError(f"{field.name} must be a bool, got {type(value).__name__}")

    @classmethod
    def sweep(cls, *, block_m: int, block_ns: Sequence[int], block_ks: Sequence[int],
              num_warps: Sequence[int] = (4, 8), num_stages: Sequence[int] = (2, 3, 4, 5),
              persistent: Sequence[bool] = (False,), max_n: int = 256,
              max_k: int = 256) -> list:
        """Every combination (``block_n``/``block_k`` clamped to ``max_n``/``max_k``, group-M
        8) that constructs and fits an SM90, without repeats, in a stable order."""
        out = []
        for n, k, w, st, pe in itertools.product(block_ns, block_ks, num_warps, num_stages,
                                                 persistent):
            cfg = cls(block_m=block_m, block_n=min(n, max_n), block_k=min(k, max_k),
                      num_warps=w, num_stages=st, group_m=8, persistent=pe)
            if cfg.fits_hopper() and cfg not in out:
                out.append(cfg)
        return out

    def with_grid(self, persistent: bool):
        """This config on a persistent grid or on one program per tile (subclasses drop
        what only one grid takes)."""
        return dataclasses.replace(self, persistent=persistent)

    def smem_bytes(self) -> int:
        """Shared memory of the K-loop pipeline (bf16 A and B tiles of every stage)."""
        per_stage = (self.block_m + self._B_TILES * self.block_n) * self.block_k * 2
        return self.num_stages * per_stage

    def accumulator_regs_per_thread(self) -> int:
        """fp32 accumulator registers per thread (Hopper has 255 per thread in all)."""
        return self._ACCUMULATORS * self.block_m * self.block_n // (32 * self.num_warps)

    def fits_hopper(self) -> bool:
        """Heuristic fit on SM90: pipeline SMEM <= 200 KiB (of 227 KiB, leaving the epilogue
        its scratch) and at most 128 accumulator registers per thread."""
        return self.smem_bytes() <= 200 * 1024 and self.accumulator_regs_per_thread() <= 128


def validate_block_m(config: GemmConfig, block_m: int | None) -> None:
    """``block_m`` given beside ``config`` must agree with it."""
    if block_m is not None and block_m != config.block_m:
        raise ValueError(
            f"block_m ({block_m}) must equal config.block_m ({config.block_m}): both name the "
            "padding multiple of the expert segments"
        )


# --------------------------------------------------------------------------------------------
# Allocation, device and grid helpers
# --------------------------------------------------------------------------------------------


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Triton launches on the current device (launchers enter ``torch.cuda.device``), so the
    # scratch belongs there. Allocated through torch's caching allocator: stream-ordered, and
    # inside CUDA-graph capture it comes from the graph's private pool. torch's CUDA blocks are
    # 512-byte aligned, above the 128 bytes a TMA descriptor needs.
    del alignment, stream
    if torch.cuda.is_available() and not interpreter_active():
        return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())
    return torch.empty(size, dtype=torch.int8)


def ensure_tma_allocator() -> None:
    """Install a torch-backed Triton scratch allocator unless one is already set.

    Kernels that build TMA descriptors on the device need 128 bytes of global scratch per
    descriptor and program. ``triton.set_allocator`` is a per-thread context variable, so this
    runs before every launch; an allocator that the caller installed is kept.
    """
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # private API moved: install ours unconditionally
        pass
    triton.set_allocator(_torch_scratch)


def device_context(device: torch.device):
    """Context in which Triton launches on ``device``."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small fixed number on the interpreter)."""
    if device.type != "cuda" or interpreter_active():
        return _INTERPRETER_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


def gemm_grid(config: GemmConfig, num_tiles_cap: int, device: torch.device) -> int:
    """Programs of a GEMM launch: one per tile of the capacity bound, or one per SM."""
    if config.persistent:
        return max(1, min(num_tiles_cap, num_sms(device)))
    return num_tiles_cap


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: int | None = None,
    shape: Sequence[int] | None = None,
    shape_text: str = "",
    contiguous: bool = True,
) -> torch.Tensor:
    """Validate one tensor argument; raise ``TypeError``/``ValueError`` naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D{' ' + shape_text if shape_text else ''}, "
            f"got shape {list(value.shape)}"
        )
    if shape is not None and list(value.shape) != list(shape):
        raise ValueError(
            f"{name} must have shape {list(shape)}{' ' + shape_text if shape_text else ''}, "
            f"got {list(value.shape)}"
        )
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {list(value.stride())}")
    return value


def check_block_counters(name: str, value: object, r_cap: int, device: torch.device,
                         programs: object) -> None:
    """Validate the row-block counters of a W13 / W2 pair run side by side (``done`` /
    ``wait``: int32 ``[R_cap / 128]`` on ``device``) and the grid ``programs`` (None or an
    int >= 1) that such a launch takes."""
    if value is not None:
        check_tensor(name, value, dtypes=(torch.int32,), shape=[r_cap // 128],
                     shape_text="[R_cap / 128] (one counter per 128 padded rows)")
        if value.device != device:
            raise ValueError(f"{name} must be on {device}, got {value.device}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int)
                                 or programs < 1):
        raise ValueError(f"programs must be None or an int >= 1 (the grid), got {programs!r}")


def check_offsets(padded_offsets: object, row_offsets: object, num_experts: int) -> None:
    """The two layout tables of every grouped-GEMM launcher: int32 ``[E_local + 1]`` each
    (their values live on the device and are not read here)."""
    check_tensor("padded_offsets", padded_offsets, dtypes=(torch.int32,),
                 shape=[num_experts + 1], shape_text="[E_local + 1]")
    check_tensor("row_offsets", row_offsets, dtypes=(torch.int32,), shape=[num_experts + 1],
                 shape_text="[E_local + 1] (live rows per expert, exclusive prefix sum)")


def check_devices(named: dict[str, torch.Tensor], *, for_kernel: bool = True) -> torch.device:
    """All tensors on one device; for a kernel, a CUDA device unless the interpreter runs."""
    items = list(named.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"{name} must be on the same device as {first_name} ({first.device}), "
                f"got {tensor.device}"
            )
    if for_kernel and first.device.type != "cuda" and not interpreter_active():
        raise ValueError(
            f"{first_name} must be on a CUDA device (or TRITON_INTERPRET=1 for CPU), "
            f"got {first.device}"
        )
    return first.device


#: Bytes of expert weights (bf16, over the rank's local experts) that a Gluon W13 or W2
#: forward must stream less of to run at 64-127 rows per expert. Fitted to one and two H200s,
#: inference, interleaved A/Bs (docs/performance.md run 38): with the Gluon kernels the layer
#: forward was 2-10% faster where the kernels stream 0.3-1.1 GB (D=2048 F=768 E=128 and 64,
#: D=2048 F=1024 E=64, D=4096 F=2048 E=32), and even to 2.7% slower at 4.3-15 GB (D=4096 and
#: 7168, F=2048, E=256 at EP=1, E=128 at EP=2). The bound sits between, where nothing was
#: measured (2 GiB itself, the W2 at D=4096 F=2048 E=128, ran only as Triton), and why the
#: weights' size decides was not established (at these rows the kernels stream weights).
GLUON_MID_ROWS_WEIGHT_BYTES = 2 * 1024**3


def gluon_mid_rows(rows_per_expert: int, num_experts: int | None,
                   weights_per_expert: int) -> bool:
    """Whether a Gluon forward kernel runs at a ``rows_per_expert`` hint of 64-127: only
    with the local expert count known and ``num_experts * weights_per_expert`` bf16 values
    (``2 F D`` for W13, ``D F`` for W2) under :data:`GLUON_MID_ROWS_WEIGHT_BYTES`."""
    if num_experts is None or not 64 <= rows_per_expert < 128:
        return False
    return num_experts * weights_per_expert * 2 < GLUON_MID_ROWS_WEIGHT_BYTES


#: Rows per expert (the heuristics' hint) at which the Gluon W13 forward's producers run in
#: lockstep (``W13Config.lockstep``), from the first to before the second; the Gluon W2
#: forward's too where each expert's W2 weights hold at least
#: :data:`LOCKSTEP_W2_WEIGHT_BYTES` (docs/performance.md runs 51-52).
LOCKSTEP_ROWS = (128, 192)
#: see :data:`LOCKSTEP_ROWS`: W2 lockstep measured 2.5-5.4% faster (forward) at 16.6 and
#: 29 MB per expert, 1% slower at 3 MB
LOCKSTEP_W2_WEIGHT_BYTES = 8 * 1024**2


#: Rows per expert (the heuristic's hint) at which the Gluon W2 DGRAD's TMA producer runs in
#: lockstep (``W2DgradConfig.lockstep``), from the first to before the second, where the
#: rank's W2 weights total at least :data:`LOCKSTEP_W2_DGRAD_WEIGHT_BYTES` (docs/performance.md
#: run 53: the kernel alone 1.05x at DeepSeek-V3's 7.5 GB and 1.10x at DeepSeek-V4-Flash's
#: 4.3 GB; even at GPT-OSS-120B's 2.1 GB, 0.95x at 0.4 GB)
LOCKSTEP_W2_DGRAD_ROWS = (96, 192)
#: see :data:`LOCKSTEP_W2_DGRAD_ROWS`
LOCKSTEP_W2_DGRAD_WEIGHT_BYTES = 3 * 1024**3


#: Rows per expert (the heuristic's hint, first to last) at which the Gluon W2 forward walks
#: its tiles in expert-group order at EP=1 (``W2Config.expert_groups``; run 59, one H100,
#: interleaved: the layer forward 1.010-1.041x at 128 to 1024 rows per expert, 0.967x at
#: 2048; run 60: the kernel in DeepSeek-V3's training step 3.10 against 3.37 ms, the fwd+bwd
#: step 1.011x there, 1.009x / 1.000x at GPT-OSS-120B / OLMoE)
EXPERT_GROUPS_W2_ROWS = (128, 1024)
#: The same for the Gluon W13 DGRAD (``W13DgradConfig.expert_groups``; run 59: the fwd+bwd
#: step 1.043x twice at 256 rows per expert under sampled routing, 1.006x exact, 1.009x at
#: 512, 0.951x at 2048; run 60, Nsight Compute: the kernel in the step 1.05-1.09x at 128
#: rows per expert, 1.25x at 256, 1.18x at 512, 0.986x at 1024; the kernel takes no fewer
#: than 128)
EXPERT_GROUPS_W13_DGRAD_ROWS = (128, 512)
#: The same for the Gluon W2 DGRAD (``W2DgradConfig.expert_groups``, at every EP size: it
#: reads its gradient rows from the rank's own scratch). Run 60, one H100, Nsight Compute on
#: the kernel in the fwd+bwd step: 3.4-11% faster at 96-512 rows per expert (DeepSeek-V3
#: 3.07 against 3.34 ms, reading 8.38 GB instead of 9.10), even at 1024 (0.98x / 1.004x),
#: 12% slower at 2048; run 61: 1.033x at 32 rows (DeepSeek-V3, T=1024), 1.099x / 1.018x /
#: 1.018x at 64 (DeepSeek-V3, GPT-OSS-120B, OLMoE); run 62: 1.027x / 1.022x at 16 / 24
#: (DeepSeek-V3, T=512 / 768), 1.037x / 1.023x at 768 (OLMoE T=6144, Qwen3-30B-A3B
#: T=12288), at 1024 0.984x / 0.83x (the two at T=8192 / 16384); the layer even at 16 and
#: 768 (1.0003x, 1.0008x); not measured below 16 or at 769-1023
EXPERT_GROUPS_W2_DGRAD_ROWS = (16, 768)


def lockstep_rows(rows_per_expert: int) -> bool:
    """Whether a ``rows_per_expert`` hint lies in :data:`LOCKSTEP_ROWS`."""
    return LOCKSTEP_ROWS[0] <= rows_per_expert < LOCKSTEP_ROWS[1]


def w2_dgrad_lockstep(*, rows_per_expert: int, num_experts: int | None, hidden: int,
                      ffn: int) -> bool:
    """Whether the Gluon W2 DGRAD's producer runs in lockstep (:data:`LOCKSTEP_W2_DGRAD_ROWS`):
    the hint in that range and the rank's ``num_experts * hidden * ffn`` bf16 W2 weights at
    least :data:`LOCKSTEP_W2_DGRAD_WEIGHT_BYTES`; never without the expert count."""
    lo, hi = LOCKSTEP_W2_DGRAD_ROWS
    return (num_experts is not None and lo <= rows_per_expert < hi
            and 2 * num_experts * hidden * ffn >= LOCKSTEP_W2_DGRAD_WEIGHT_BYTES)


def lockstep_counter(lockstep: bool, placeholder: torch.Tensor) -> torch.Tensor:
    """The ``sync_ptr`` argument of a Gluon kernel with lockstep producers: with ``lockstep``
    a zeroed int32 counter on ``placeholder``'s device, allocated per launch (the producers
    count their issued tiles in it), else ``placeholder``, which the kernel does not read."""
    if lockstep:
        return torch.zeros(1, dtype=torch.int32, device=placeholder.device)
    return placeholder


#: Bytes of one expert's weight gradient (``out_rows * out_cols`` bf16) from which the Gluon
#: WGRAD takes 256 x 128 output tiles (:meth:`~distmoe.kernels.w2_backward.WgradConfig.
#: hopper_gluon`): each row of its B operand loaded once per 256 output rows instead of 128.
#: Layer fwd+bwd on one H100 (docs/performance.md run 54, sampled routing): 2.1-13.2% faster
#: at 15.8-56 MiB per expert (DeepSeek-V3 and V4-Flash, GPT-OSS-120B, T=8192 D=4096 F=2048
#: E=32), 3% slower or even at 3-8 MiB (OLMoE, T=2048-16384 D=2048 F=768 E=128)
WGRAD_WIDE_TILE_EXPERT_BYTES = 12 * 1024**2


#: Bytes of one expert's weight gradient from which the Gluon WGRAD's 256 x 128 tiles run
#: with their producers in lockstep (:attr:`~distmoe.kernels.w2_backward.WgradConfig.
#: lockstep`): an expert whose gradient outgrows the 50 MB L2 streams its own rows out of it
#: before the programs that lag behind read them. One H100 (docs/performance.md run 55):
#: DeepSeek-V3's W13 WGRAD (56 MiB an expert) alone 1.41x, its layer fwd+bwd 1.050x under
#: sampled routing with this one on (both WGRADs: 1.045x; 1.11x exact); at 28-32 MiB (its
#: W2, DeepSeek-V4-Flash, GPT-OSS-120B, T=8192 D=4096 F=2048 E=32) the layer 0.99-1.00x
#: under sampled routing.
WGRAD_LOCKSTEP_EXPERT_BYTES = 48 * 1024**2


#: Device memory from which a Hopper GPU counts as HBM3e-class for the WGRAD's tile rule
#: (:func:`wgrad_wide_tiles`): the H200's 141 GB (4.8 TB/s; torch reports 140.4 GiB) and
#: GH200's 144 GB, against the H100's 80 GB (3.35 TB/s; 79.6 GiB) on the same 132 SMs.
#: Memory size stands in for DRAM bandwidth, which torch does not report; parts between
#: (H20, H100 NVL: 94-96 GB, about 4 TB/s) are unmeasured and take the H100's rule.
HBM3E_MEMORY_BYTES = 120 * 1024**3

#: On an HBM3e-class device (:data:`HBM3E_MEMORY_BYTES`), the rows per expert (the shape
#: hint) from which the WGRAD's 256 x 128 tiles are taken; below, its ping-pong 128 x 128
#: tiles. One H200 (docs/performance.md run 57, layer fwd+bwd, 15 rounds): ping-pong faster
#: at 96-128 rows per expert (DeepSeek-V3 1.029x sampled / 1.035x exact, GPT-OSS-120B
#: 1.048x exact, DeepSeek-V4-Flash 1.025x sampled, even exact), the 256 x 128 tiles faster at
#: 2048 (T=8192 D=4096 F=2048 E=32: 1.028x over ping-pong; run 47: 16.29 against 16.42 ms
#: over the two cooperating warpgroups). 1024 is where the cooperating warpgroups begin;
#: between 128 and 2048 rows the line is not measured.
WGRAD_WIDE_TILE_ROWS_HBM3E = 1024


def wgrad_lockstep(*, out_rows: int, out_cols: int, rows_per_expert: int | None = None,
                   device_memory: int | None = None) -> bool:
    """Whether the Gluon WGRAD over a TMA-fed B (256 x 128 tiles) starts each wave of tiles
    together: it takes those tiles (:func:`wgrad_wide_tiles`, same arguments) and each
    expert's ``out_rows x out_cols`` bf16 gradient holds at least
    :data:`WGRAD_LOCKSTEP_EXPERT_BYTES`."""
    return (wgrad_wide_tiles(out_rows=out_rows, out_cols=out_cols,
                             rows_per_expert=rows_per_expert, device_memory=device_memory)
            and 2 * out_rows * out_cols >= WGRAD_LOCKSTEP_EXPERT_BYTES)


def wgrad_wide_tiles(*, out_rows: int, out_cols: int, rows_per_expert: int | None = None,
                     device_memory: int | None = None) -> bool:
    """Whether the Gluon WGRAD over a TMA-fed B takes 256 x 128 output tiles: each expert's
    ``out_rows x out_cols`` bf16 gradient at least :data:`WGRAD_WIDE_TILE_EXPERT_BYTES`, at
    least 256 rows and 128 columns; and on a device with ``device_memory`` bytes (``None``:
    not known) of at least :data:`HBM3E_MEMORY_BYTES`, a ``rows_per_expert`` hint (``None``:
    none given) of at least :data:`WGRAD_WIDE_TILE_ROWS_HBM3E`."""
    if not (out_rows >= 256 and out_cols >= 128
            and 2 * out_rows * out_cols >= WGRAD_WIDE_TILE_EXPERT_BYTES):
        return False
    if device_memory is None or device_memory < HBM3E_MEMORY_BYTES or rows_per_expert is None:
        return True
    return rows_per_expert >= WGRAD_WIDE_TILE_ROWS_HBM3E


def device_memory_bytes(device: torch.device | str | None) -> int | None:
    """Total memory of CUDA ``device`` in bytes (``None`` for no device or a CPU one): the
    device-model key of :func:`wgrad_wide_tiles`. Read from the driver's cached properties, no
    synchronisation."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def gluon_device(device: torch.device | str | None) -> bool:
    """Whether ``device`` runs the warp-specialised Gluon kernels
    (:func:`~distmoe.kernels.wgrad_gluon.gluon_device_reason`: Hopper, not the interpreter);
    ``None`` (no device given to a heuristic) does not."""
    if device is None:
        return False
    from .wgrad_gluon import gluon_device_reason

    return gluon_device_reason(torch.device(device)) is None


def config_gluon_reason(config: GemmConfig, kernel_reason: Callable[..., str | None],
                        device: torch.device, hidden: int, ffn: int) -> str | None:
    """``None`` when ``config`` (a grouped-GEMM config with a ``gluon`` field) runs its Gluon
    kernel on ``device`` at D = ``hidden``, F = ``ffn``, else why not (``config.gluon`` False
    included): ``kernel_reason`` is the kernel module's ``gluon_*_reason`` check, given the
    config's tile, ring depth and warps."""
    if not config.gluon:
        return "the config asks for the Triton kernel"
    return kernel_reason(device, hidden=hidden, ffn=ffn, block_m=config.block_m,
                         block_n=config.block_n, block_k=config.block_k,
                         stages=config.num_stages, warps=config.num_warps)


def warn_gluon_fallback(kernel: str, reason: str) -> None:
    """A config asked for a Gluon kernel (``gluon=True``) that cannot run this call: say why,
    as a ``RuntimeWarning`` (Python shows each message once per call site); the caller then
    runs the Triton kernel with the same config. The heuristics only pick Gluon where it
    runs, so this fires on explicit requests (a hand-written config, ``tools/ab_bench.py``)."""
    warnings.warn(f"{kernel}: config.gluon is set, but the Gluon kernel cannot run this call "
                  f"({reason}); the Triton kernel runs the config instead", RuntimeWarning,
                  stacklevel=3)


def check_tma_aligned(name: str, tensor: torch.Tensor) -> None:
    """A TMA descriptor's base must be 16-byte aligned."""
    if tensor.data_ptr() % TMA_ALIGN_BYTES:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address (TMA descriptor base), "
            f"got {tensor.data_ptr():#x}"
        )


def check_width(name: str, value: int) -> None:
    """A row width (D or F) must be a positive multiple of 8 (whole 16-byte bf16 vectors)."""
    if value <= 0 or value % 8:
        raise ValueError(
            f"{name} ({value}) must be a positive multiple of 8 (16-byte bf16 rows: TMA "
            "strides and vectorised row loads/stores)"
        )


# --------------------------------------------------------------------------------------------
# Row addresses (references and tests)
# --------------------------------------------------------------------------------------------


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` byte addresses of a contiguous tensor's elements."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def row_address(tensor: torch.Tensor, row: int | torch.Tensor, *, row_elems: int) -> torch.Tensor:
    """int64 absolute byte address of row ``row`` of ``tensor`` seen as rows of ``row_elems``."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous to address its rows")
    row = torch.as_tensor(row, dtype=torch.int64)
    return tensor.data_ptr() + row * (row_elems * tensor.element_size())


def locate_rows(
    addresses: torch.Tensor, tensors: Sequence[torch.Tensor], *, row_elems: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map absolute row addresses to ``(tensor index, row index)`` (CPU int64 tensors).

    Address 0 is a null row (tensor index -1). Every other address must be the start of a
    row of ``row_elems`` elements inside one of ``tensors`` (contiguous); otherwise a
    ``ValueError`` names the argument and the first offending address.
    """
    addr = addresses.detach().to("cpu", torch.int64).reshape(-1)
    which = torch.full_like(addr, -1)
    row = torch.zeros_like(addr)
    for i, tensor in enumerate(tensors):
        if not tensor.is_contiguous() or tensor.numel() % row_elems:
            raise ValueError(
                f"row source {i} must be contiguous with a multiple of {row_elems} elements, "
                f"got shape {list(tensor.shape)} strides {list(tensor.stride())}"
            )
        base = tensor.data_ptr()
        row_bytes = row_elems * tensor.element_size()
        offset = addr - base
        inside = (offset >= 0) & (offset < tensor.numel() * tensor.element_size())
        misaligned = inside & (offset % row_bytes != 0)
        if bool(misaligned.any()):
            bad = int(addr[misaligned][0])
            raise ValueError(f"{name} holds {bad:#x}, not the start of a row of tensor {i}")
        which[inside] = i
        row[inside] = offset[inside] // row_bytes
    unknown = (addr != 0) & (which < 0)
    if bool(unknown.any()):
        bad = int(addr[unknown][0])
        raise ValueError(f"{name} holds {bad:#x}, which lies in none of the given tensors")
    return which, row


def rows_at(
    addresses: torch.Tensor, tensors: Sequence[torch.Tensor], *, row_elems: int, name: str
) -> torch.Tensor:
    """Rows at ``addresses`` as ``[N, row_elems]`` float32 (zeros for null addresses)."""
    which, row = locate_rows(addresses, tensors, row_elems=row_elems, name=name)
    device = tensors[0].device if tensors else addresses.device
    out = torch.zeros(which.numel(), row_elems, dtype=torch.float32, device=device)
    for i, tensor in enumerate(tensors):
        hit = (which == i).nonzero().reshape(-1)
        if hit.numel():
            src = tensor.reshape(-1, row_elems)[row[hit].to(tensor.device)]
            out[hit.to(device)] = src.to(device=device, dtype=torch.float32)
    return out


def write_rows_at(
    addresses: torch.Tensor,
    values: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    name: str,
) -> None:
    """Write ``values[i]`` into the row at ``addresses[i]`` (skipped where the address is 0)."""
    row_elems = values.shape[-1]
    which, row = locate_rows(addresses, tensors, row_elems=row_elems, name=name)
    for i, tensor in enumerate(tensors):
        hit = (which == i).nonzero().reshape(-1)
        if hit.numel():
            rows_view = tensor.view(-1, row_elems)
            rows_view[row[hit].to(tensor.device)] = values[hit.to(values.device)].to(
                device=tensor.device, dtype=tensor.dtype
            )


def expert_segments(padded_offsets: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` row ranges of the local experts (host copy: references only)."""
    offsets = padded_offsets.detach().to("cpu", torch.int64).tolist()
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def check_padded_offsets_host(padded_offsets: torch.Tensor, *, block_m: int, r_cap: int) -> None:
    """Check the padded layout on the host (references only: it synchronises)."""
    offsets = padded_offsets.detach().to("cpu", torch.int64).tolist()
    if offsets[0] != 0:
        raise ValueError(f"padded_offsets[0] ({offsets[0]}) must be 0")
    for e, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        if end < start or (end - start) % block_m:
            raise ValueError(
                f"padded_offsets segment of expert {e} [{start}, {end}) must be non-negative "
                f"and a multiple of block_m ({block_m})"
            )
    if offsets[-1] > r_cap:
        raise ValueError(f"padded_offsets[-1] ({offsets[-1]}) must be <= R_cap ({r_cap})")


# --------------------------------------------------------------------------------------------
# Triton helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def tile_expert(
    padded_offsets_ptr, row_start, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr
):
    """Local expert owning the row tile that starts at ``row_start``.

    Counts the segment ends ``padded_offsets[1:]`` at or below ``row_start`` (empty experts
    included), clamped to the last expert (callers only ask for live tiles).
    ``EXPERTS_POW2`` is ``next_power_of_2(NUM_EXPERTS)``.
    """
    idx = tl.arange(0, EXPERTS_POW2)
    ends = tl.load(padded_offsets_ptr + 1 + idx, mask=idx < NUM_EXPERTS, other=2147483647)
    expert = tl.sum((ends <= row_start).to(tl.int32), axis=0)
    return tl.minimum(expert, NUM_EXPERTS - 1)


@triton.jit
def swizzle_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Group-M order: ``GROUP_M`` consecutive row tiles sweep the columns together, so
    programs running at the same time share weight tiles (and row tiles) in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def fused_tile(t, num_pid_m, N13: tl.constexpr, N2: tl.constexpr, GROUP_M: tl.constexpr,
               LAG: tl.constexpr):
    """Position ``t`` of a fused W13 + W2 schedule (:mod:`distmoe.kernels.w13_w2_gluon`):
    ``(is_w2, index)``, the index in that GEMM's own group-M stream (:func:`swizzle_tile`
    with ``N13`` or ``N2`` column tiles; ``num_pid_m`` row blocks in both).

    The schedule runs in periods of ``GROUP_M`` row blocks: period ``p`` holds W13's group
    ``p``, then W2's group ``p - LAG`` (``L = min(LAG, groups)``, ``LAG >= 1``), so a W2
    tile comes at least ``L`` W13 groups after the W13 tiles of its rows. Only the last
    group of each GEMM may be short. :func:`fused_schedule_ref` is the reference."""
    S13 = GROUP_M * N13
    S2 = GROUP_M * N2
    n13 = num_pid_m * N13
    ng = (num_pid_m + GROUP_M - 1) // GROUP_M
    lag = tl.minimum(ng, LAG)
    period = S13 + S2
    # every W13 group first, then every W2 group (lag reaches the group count)
    all_first_w2 = t >= n13
    all_first_idx = tl.where(all_first_w2, t - n13, t)
    # the first lag W13 groups (full), the periods lag .. ng - 2 (full), then the last
    # W13 group (maybe short) and the W2 groups left (the last one maybe short)
    head = lag * S13
    u = tl.maximum(t - head, 0)
    regular = (ng - 1 - lag) * period
    p_rel = u // period
    r = u % period
    reg_w2 = r >= S13
    reg_idx = tl.where(reg_w2, p_rel * S2 + r - S13, (p_rel + lag) * S13 + r)
    t2 = u - regular
    last13 = n13 - (ng - 1) * S13
    tail_w2 = t2 >= last13
    tail_idx = tl.where(tail_w2, (ng - 1 - lag) * S2 + t2 - last13, (ng - 1) * S13 + t2)
    in_head = t < head
    in_reg = u < regular
    lagged_w2 = tl.where(in_head, False, tl.where(in_reg, reg_w2, tail_w2))
    lagged_idx = tl.where(in_head, t, tl.where(in_reg, reg_idx, tail_idx))
    short = lag >= ng
    return (tl.where(short, all_first_w2, lagged_w2),
            tl.where(short, all_first_idx, lagged_idx))


def fused_schedule_ref(num_pid_m: int, n13: int, n2: int, group_m: int,
                       lag: int) -> list[tuple[bool, int]]:
    """The positions of :func:`fused_tile`, built period by period: ``(is_w2, index)``."""
    groups = -(-num_pid_m // group_m)
    lag = min(lag, groups)
    size = [min(group_m, num_pid_m - g * group_m) for g in range(groups)]
    first = [g * group_m for g in range(groups)]
    out: list[tuple[bool, int]] = []
    for p in range(groups + lag):
        if p < groups:
            out += [(False, first[p] * n13 + i) for i in range(size[p] * n13)]
        q = p - lag
        if 0 <= q < groups:
            out += [(True, first[q] * n2 + i) for i in range(size[q] * n2)]
    return out


# --------------------------------------------------------------------------------------------
# Compact activation rows (forward kernels)
# --------------------------------------------------------------------------------------------
#
# Activation tensors (h2, h1, saved x) hold one row per *live* row, expert-major and without
# padding. ``row_offsets`` int32 ``[E_local + 1]`` on the device is the exclusive prefix sum of
# live rows per local expert: expert ``e`` has ``n_e = row_offsets[e+1] - row_offsets[e]``
# live rows (``n_e`` <= its padded segment length); padded row ``padded_offsets[e] + j`` is
# live iff ``j < n_e`` and its activation row is ``row_offsets[e] + j``. The padded rows stay
# the tile schedule and the index of the pointer tables.


def check_bf16_base(name: str, value: object) -> torch.Tensor:
    """A 1-D contiguous bf16 base tensor indexed by device-side element offsets.

    Its start must be 16-byte aligned (the kernels store 16-byte vectors at ``base + offset``
    with offsets that are multiples of 8 elements).
    """
    check_tensor(name, value, dtypes=(torch.bfloat16,), ndim=1, shape_text="(a bf16 base)")
    if value.data_ptr() % TMA_ALIGN_BYTES:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address (16-byte vector stores), "
            f"got {value.data_ptr():#x}"
        )
    return value


def check_activation_rows(name: str, tensor: torch.Tensor, *, r_cap: int) -> int:
    """Rows ``R_act`` of a 2-D activation tensor: at least 1 when there is work (``r_cap > 0``).

    ``R_act >= row_offsets[E_local]`` is the caller's contract (a device value: not checked).
    """
    r_act = tensor.shape[0]
    if r_cap > 0 and r_act < 1:
        raise ValueError(
            f"{name} must have R_act >= 1 rows (activation rows, R_act >= row_offsets[E_local]) "
            f"when R_cap ({r_cap}) > 0, got shape {list(tensor.shape)}"
        )
    return r_act


def activation_segments(
    padded_offsets: torch.Tensor, row_offsets: torch.Tensor
) -> list[tuple[int, int, int]]:
    """``[(padded_start, activation_start, live_rows)]`` per local expert (host copy: references
    and tests only; it synchronises)."""
    padded = padded_offsets.detach().to("cpu", torch.int64).tolist()
    act = row_offsets.detach().to("cpu", torch.int64).tolist()
    return [(padded[e], act[e], act[e + 1] - act[e]) for e in range(len(padded) - 1)]


def check_row_offsets_host(
    padded_offsets: torch.Tensor, row_offsets: torch.Tensor, *, r_act: int | None = None
) -> None:
    """Check ``row_offsets`` against the padded layout on the host (references only)."""
    padded = padded_offsets.detach().to("cpu", torch.int64).tolist()
    act = row_offsets.detach().to("cpu", torch.int64).tolist()
    if act[0] != 0:
        raise ValueError(f"row_offsets[0] ({act[0]}) must be 0")
    for e in range(len(act) - 1):
        live, seg = act[e + 1] - act[e], padded[e + 1] - padded[e]
        if not 0 <= live <= seg:
            raise ValueError(
                f"row_offsets gives expert {e} {live} live rows; must be in [0, {seg}] (its "
                f"padded segment [{padded[e]}, {padded[e + 1]}))"
            )
    if r_act is not None and act[-1] > r_act:
        raise ValueError(
            f"row_offsets[-1] ({act[-1]}) must be <= R_act ({r_act}, rows of the activations)"
        )


@triton.jit
def tile_activation_rows(padded_offsets_ptr, row_offsets_ptr, expert, row_start):
    """Activation rows of the row tile at padded row ``row_start`` of ``expert``.

    Returns ``(act_start, num_live)``: the tile's padded row ``row_start + i`` maps to
    activation row ``act_start + i`` (int64) and is live iff ``i < num_live`` (``num_live``
    int32, <= 0 for a tile of padding rows only, may exceed ``BLOCK_M``).
    """
    seg_start = tl.load(padded_offsets_ptr + expert)
    act_begin = tl.load(row_offsets_ptr + expert)
    act_end = tl.load(row_offsets_ptr + expert + 1)
    local = row_start - seg_start
    act_start = act_begin.to(tl.int64) + local
    num_live = act_end - act_begin - local
    return act_start, num_live
