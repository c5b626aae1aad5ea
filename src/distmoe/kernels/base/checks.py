"""Input validation shared by the kernel families: each helper raises ``TypeError`` /
``ValueError`` naming the argument.

* tensors, devices and layout tables (:func:`check_tensor`, :func:`check_devices`,
  :func:`check_offsets`, :func:`check_block_counters`);
* TMA and row-width rules (:func:`check_tma_aligned`, :func:`check_width`);
* activation rows and bases of the forward kernels (:func:`check_bf16_base`,
  :func:`check_activation_rows`) and of the backward ones (:func:`check_activation_width`,
  :func:`check_base_tensor`, :func:`check_device_scalar`, :func:`check_row_table`,
  :func:`check_rows_cap`, :func:`check_disjoint`);
* the ``R_cap`` rule of the gather and scatter launchers (:func:`check_gather_r_cap`,
  :func:`check_scatter_r_cap`);
* host checks of the two row tables for the references (:func:`check_padded_offsets_host`,
  :func:`check_row_offsets_host`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distmoe.kernels.base.config import GemmConfig
from distmoe.kernels.base.interpreter import interpreter_active
from distmoe.kernels.base.rows import byte_range

# TMA: every stride but the last and every base address must be a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16


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
    """Validate row-block counters (``value``, None or int32 ``[R_cap / 128]`` on ``device``)
    and the grid ``programs`` (None or an int >= 1) of a launch whose W2 tiles wait for its
    W13 tiles (:func:`~distmoe.kernels.mega.gluon.fused_w13_w2`)."""
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


def check_expert_count(padded_offsets: object) -> int:
    """``padded_offsets`` int32 ``[E_local + 1]`` with E_local >= 1; returns E_local."""
    check_tensor("padded_offsets", padded_offsets, dtypes=(torch.int32,), ndim=1,
                 shape_text="[E_local + 1]")
    num_experts = padded_offsets.shape[0] - 1
    if num_experts < 1:
        raise ValueError(f"padded_offsets must have E_local + 1 >= 2 entries, got "
                         f"{list(padded_offsets.shape)}")
    return num_experts


def check_expert_tables(padded_offsets: object, row_offsets: object) -> int:
    """The per-expert tables of a row-moving kernel: ``padded_offsets`` int32 ``[E + 1]`` with
    E >= 1, ``row_offsets`` alike (:func:`check_offsets`); returns E."""
    num_experts = check_expert_count(padded_offsets)
    check_offsets(padded_offsets, row_offsets, num_experts)
    return num_experts


def check_block_m(block_m: object) -> None:
    """``block_m``, the padding multiple: a power of two >= 16."""
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 16 \
            or block_m & (block_m - 1):
        raise ValueError(f"block_m ({block_m!r}) must be a power of two >= 16")


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


def check_gather_r_cap(r_cap: int, block_m: int) -> None:
    if r_cap % block_m:
        raise ValueError(
            f"R_cap ({r_cap}, rows of gather_ptrs) must be a multiple of block_m ({block_m})"
        )


def check_scatter_r_cap(r_cap: int, block_m: int) -> None:
    if r_cap % block_m:
        raise ValueError(
            f"R_cap ({r_cap}, rows of scatter_ptrs) must be a multiple of block_m ({block_m})"
        )


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


# --------------------------------------------------------------------------------------------
# Backward GEMMs (W2 DGRAD, W13 DGRAD, WGRAD)
# --------------------------------------------------------------------------------------------


def check_backward_gemm_config(config: GemmConfig) -> None:
    """Rules that the backward DGRAD configs add to :class:`GemmConfig`.

    None today: both DGRAD kernels take every :class:`GemmConfig`, ``persistent`` and
    ``host_descriptors`` in any combination. Kept as the one place for DGRAD-only rules.
    """
    del config


def check_disjoint(
    named: dict[str, torch.Tensor], *, same_ok: tuple[str, str] | None = None
) -> None:
    """Raise ``ValueError`` if two of the tensors share bytes (``same_ok`` names one pair that
    may be the identical tensor storage, e.g. an in-place output)."""
    items = [(n, t, *byte_range(t)) for n, t in named.items()
             if t is not None and t.numel() > 0]
    for i, (name_a, a, lo_a, hi_a) in enumerate(items):
        for name_b, b, lo_b, hi_b in items[i + 1 :]:
            if lo_a < hi_b and lo_b < hi_a:
                identical = (lo_a, hi_a) == (lo_b, hi_b) and a.shape == b.shape
                if identical and same_ok is not None and {name_a, name_b} == set(same_ok):
                    continue
                raise ValueError(
                    f"{name_a} and {name_b} must not overlap in memory, got "
                    f"[{lo_a:#x}, {hi_a:#x}) and [{lo_b:#x}, {hi_b:#x})"
                )


def check_device_scalar(name: str, value: object, rule: str) -> None:
    """A device-side int64 ``[1]`` argument (offset or address); ``rule`` says what it holds."""
    check_tensor(name, value, dtypes=(torch.int64,), shape=[1], shape_text=rule)


def check_base_tensor(name: str, value: object, offset_name: str, row_text: str) -> None:
    """The 1-D contiguous bf16 base that ``offset_name`` indexes (16-byte aligned start)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(
            f"{name} must be a 1-D bf16 base tensor when {offset_name} is given "
            f"({row_text}), got shape {list(value.shape)}"
        )
    check_tensor(name, value, dtypes=(torch.bfloat16,), ndim=1, shape_text=f"({row_text})")
    if value.data_ptr() % 16:
        raise ValueError(
            f"{name} must start at a 16-byte aligned address ({offset_name} counts from it and "
            f"activation rows are 16-byte aligned), got {value.data_ptr():#x}"
        )


def check_activation_width(name: str, value: object, width: int, width_text: str) -> int:
    """A 2-D bf16 ``[R_act, width]`` tensor in activation rows; returns ``R_act``."""
    check_tensor(name, value, dtypes=(torch.bfloat16,), ndim=2, shape_text=f"[R_act, {width_text}]")
    if value.shape[1] != width:
        raise ValueError(
            f"{name} must have shape [R_act, {width}] ([R_act, {width_text}], activation rows), "
            f"got {list(value.shape)}"
        )
    return value.shape[0]


def check_row_table(name: str, table: object) -> int:
    """An int64 ``[R_cap]`` table of absolute row addresses; returns ``R_cap``."""
    check_tensor(name, table, dtypes=(torch.int64,), ndim=1, shape_text="[R_cap]")
    return table.shape[0]


def check_rows_cap(num_rows: int, block_m: int) -> None:
    """``R_cap`` must be a multiple of the padding multiple ``block_m``."""
    if num_rows % block_m:
        raise ValueError(
            f"R_cap ({num_rows}) must be a multiple of config.block_m ({block_m}), the padding "
            "multiple of the expert segments"
        )
