"""Per-layer byte costs of one routed-expert layer on one rank, tensor by tensor.

Pure Python: nothing here allocates or touches a device. Every figure is a sum of tensors,
each rounded up on its own with ``align128(n) = ceil(n / 128) * 128`` bytes, because each
tensor starts at a 128-byte aligned offset in the activation buffer.

Legend (docs/design.md, Notation and the math): T = ``cfg.max_tokens`` tokens per rank,
D = ``cfg.hidden``, F = ``cfg.ffn``, K = ``cfg.top_k``, E_local = experts per rank, R = rows
received by this rank, Rp = R padded per expert (see :func:`padded_rows`).

Three kinds of cost exist per layer:

* **input**: what a replayed layer keeps until backward, the layer input ``x [T, D]`` bf16.
* **full state**: what a saved layer keeps until backward, so that backward runs without
  replaying the forward.
* **scratch**: temporaries of one call (forward with state omitted, or backward with
  replay). Scratch is shared by all layers and slots, so only its peak matters. A layout is
  described by :class:`ScratchLayout`: tensors resident for the whole call plus a shared
  interval that a sequence of phases reuses one after another.

Row padding rule. bf16 tensors hold exactly R rows (null gather entries are masked, never
stored). Block-scaled formats index rows by the padded, expert-major GEMM position, so
every expert's rows are padded to a multiple P: ``P = max(row_block, 32)`` for mxfp8 (a
column-oriented E8M0 scale covers 32 rows and must not straddle two experts; both are powers
of two, so this is their least common multiple) and ``P = row_block`` for nvfp4 (its scales
run along the row only). The planner knows R but not how R splits over the E_local experts,
so it takes the worst split: every non-empty expert may waste up to P - 1 rows, which gives
``Rp = P * R`` when ``R <= E_local`` and ``Rp = P * (E_local + (R - E_local) // P)``
otherwise (one row in each expert, then whole blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from distmoe.config import MoEConfig

ALIGN_BYTES = 128

MX_BLOCK = 32  # mxfp8: values per E8M0 scale
FP8_BLOCK = 128  # fp8_block: values per float32 scale
NVFP4_BLOCK = 16  # nvfp4: values per E4M3 scale

#: From this many rows per local expert (the shape hint ``T_max*K*EP/E``) a layer that keeps
#: x instead of its gathered rows has its W13 WGRAD read those rows in place at EP = 1 (see
#: :func:`rows_in_place`).
ROWS_IN_PLACE_FROM = 512


def rows_in_place(cfg: MoEConfig, ep_size: int) -> bool:
    """Whether a training layer's backward reads a kept input's rows in place, so that it
    needs no scratch copy of them (``x_gathered`` leaves the backward scratch): bf16, EP = 1,
    ``save_gathered_rows`` False or ``"auto"`` (a layer that kept its rows then has them read
    in order by the same kernel), and ``cfg.gathered_rows_in_place``, or where that is None
    and ``save_gathered_rows`` is False, at least :data:`ROWS_IN_PLACE_FROM` rows per local
    expert (the shape hint). Under ``"auto"`` None copies: there the step is slower with the
    rows read in place.

    Why the threshold: the in-place WGRAD copies its rows by ``cp.async`` from a table read
    per 64-row step, which beats a separate copy from 512 rows per expert but not at 256,
    where a tile is four such steps (evidence: docs/performance.md)."""
    if (not cfg.training or cfg.precision != "bf16" or ep_size != 1
            or cfg.save_gathered_rows is True):
        return False
    if cfg.gathered_rows_in_place is not None:
        return cfg.gathered_rows_in_place
    if cfg.save_gathered_rows == "auto":  # copied unless forced (slower in place)
        return False
    return max(1, cfg.max_tokens * cfg.top_k // cfg.experts_per_rank(ep_size)) \
        >= ROWS_IN_PLACE_FROM


# Bytes per stored element. "e2m1x2" is one byte holding two packed E2M1 values, so a packed
# tensor's shape already counts bytes (its last dimension is width / 2).
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp32": 4, "e4m3": 1, "e8m0": 1, "e2m1x2": 1}


def align128(num_bytes: int) -> int:
    """Round ``num_bytes`` up to a multiple of 128 bytes."""
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


class TensorBytes(NamedTuple):
    """One tensor of a cost breakdown: ``(name, shape, dtype, num_bytes)``.

    ``num_bytes`` is ``align128(prod(shape) * DTYPE_BYTES[dtype])``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    num_bytes: int


def tensor_bytes(name: str, shape: tuple[int, ...], dtype: str) -> TensorBytes:
    """Build a :class:`TensorBytes` with its aligned byte size."""
    return TensorBytes(name, shape, dtype, align128(math.prod(shape) * DTYPE_BYTES[dtype]))


def total_bytes(tensors: tuple[TensorBytes, ...] | list[TensorBytes]) -> int:
    """Sum of ``num_bytes`` over a breakdown."""
    return sum(t.num_bytes for t in tensors)


@dataclass(frozen=True, kw_only=True)
class ScratchLayout:
    """Temporaries of one call and how they share space.

    Attributes:
        name: what the layout is for (``"forward"``, ``"backward replay"``).
        resident: tensors live for the whole call; each has its own region.
        phases: groups of tensors that reuse one shared interval one after another (a later
            group is written only after the earlier group's last reader finished).
    """

    name: str
    resident: tuple[TensorBytes, ...]
    phases: tuple[tuple[TensorBytes, ...], ...] = ()

    @property
    def peak_bytes(self) -> int:
        """``sum(resident) + max over phases of sum(phase)``."""
        shared = max((total_bytes(p) for p in self.phases), default=0)
        return total_bytes(self.resident) + shared

    def tensors(self) -> list[TensorBytes]:
        """Every tensor of the layout, resident first, then phase by phase."""
        return [*self.resident, *(t for phase in self.phases for t in phase)]


@dataclass(frozen=True, kw_only=True)
class LayerCosts:
    """Byte costs of one layer on one rank that received ``rows`` rows.

    Attributes:
        rows: R, rows received by the rank.
        padded_rows: Rp, R after worst-case per-expert padding (equal to R for bf16).
        input: tensors a replayed layer keeps (empty for inference).
        full_state: tensors a saved layer keeps (empty for inference).
        forward_scratch: forward temporaries with the state omitted (replay or inference).
        backward_scratch: backward temporaries when the layer replays (training only; a
            saved layer's backward needs a subset of them).
    """

    rows: int
    padded_rows: int
    input: tuple[TensorBytes, ...]
    full_state: tuple[TensorBytes, ...]
    forward_scratch: ScratchLayout
    backward_scratch: ScratchLayout | None

    @property
    def input_bytes(self) -> int:
        return total_bytes(self.input)

    @property
    def full_state_bytes(self) -> int:
        return total_bytes(self.full_state)

    @property
    def scratch_bytes(self) -> int:
        """Peak scratch of one call: the larger of the forward and backward layouts."""
        peaks = [self.forward_scratch.peak_bytes]
        if self.backward_scratch is not None:
            peaks.append(self.backward_scratch.peak_bytes)
        return max(peaks)


# --------------------------------------------------------------------------- row padding
def row_multiple(cfg: MoEConfig) -> int:
    """Per-expert row padding multiple P: 1 (bf16), max(row_block, 32) (mxfp8),
    max(row_block, 128) (fp8_block), row_block (nvfp4): FP8 column bundles quantise along
    the rows, in whole blocks."""
    if cfg.precision == "bf16":
        return 1
    if cfg.precision in ("mxfp8", "fp8_block"):
        return max(cfg.row_block, fp8_format(cfg)[0])
    return cfg.row_block


def padded_rows(cfg: MoEConfig, ep_size: int, rows: int) -> int:
    """Worst-case Rp for ``rows`` received rows spread over ``E_local`` experts.

    bf16: ``Rp = R``. Otherwise with P = :func:`row_multiple`: ``Rp = P * R`` if
    ``R <= E_local`` (each row alone in an expert) else ``P * (E_local + (R - E_local) // P)``.
    """
    num_local_experts = cfg.experts_per_rank(ep_size)
    multiple = row_multiple(cfg)
    if multiple == 1 or rows == 0:
        return rows
    if rows <= num_local_experts:
        return multiple * rows
    return multiple * (num_local_experts + (rows - num_local_experts) // multiple)


# --------------------------------------------------------------------------- bundles
def fp8_format(cfg: MoEConfig) -> tuple[int, str]:
    """``(values per scale, scale dtype)`` of an FP8 precision's operand bundles: mxfp8
    ``(32, "e8m0")``, fp8_block ``(128, "fp32")`` (its 1 x 128 activation blocks)."""
    return (FP8_BLOCK, "fp32") if cfg.precision == "fp8_block" else (MX_BLOCK, "e8m0")


def _mx_row_bundle(name: str, rows: int, width: int, block: int = MX_BLOCK,
                   kind: str = "e8m0") -> tuple[TensorBytes, ...]:
    """FP8 row-oriented bundle of a [rows, width] operand: scales (one per ``block``
    values, dtype ``kind``) run along width."""
    return (
        tensor_bytes(f"{name}.qdata", (rows, width), "e4m3"),
        tensor_bytes(f"{name}.scale", (rows, width // block), kind),
    )


def _mx_col_bundle(name: str, rows: int, width: int, block: int = MX_BLOCK,
                   kind: str = "e8m0") -> tuple[TensorBytes, ...]:
    """FP8 column-oriented bundle (for WGRAD, which contracts over rows): stored
    transposed, scales run along the rows; ``rows`` is a multiple of ``block``."""
    assert rows % block == 0, f"column bundle rows ({rows}) must be a multiple of {block}"
    return (
        tensor_bytes(f"{name}.qdata", (width, rows), "e4m3"),
        tensor_bytes(f"{name}.scale", (width, rows // block), kind),
    )


def _nvfp4_row_bundle(name: str, rows: int, width: int) -> tuple[TensorBytes, ...]:
    """NVFP4 bundle of a [rows, width] operand: packed E2M1 pairs, one E4M3 scale per 16
    values, one fp32 global scale per row."""
    return (
        tensor_bytes(f"{name}.qdata", (rows, width // 2), "e2m1x2"),
        tensor_bytes(f"{name}.scale", (rows, width // NVFP4_BLOCK), "e4m3"),
        tensor_bytes(f"{name}.global_scale", (rows,), "fp32"),
    )


# --------------------------------------------------------------------------- layer costs
def input_breakdown(cfg: MoEConfig) -> tuple[TensorBytes, ...]:
    """Replay input of one layer: ``x [T, D] bf16`` in training, nothing in inference.

    Bytes: ``align128(T * D * 2)``. mxfp8 training keeps bf16 too (it quantises after the
    peer gather, so the source rows stay bf16).
    """
    if not cfg.training:
        return ()
    return (tensor_bytes("x", (cfg.max_tokens, cfg.hidden), "bf16"),)


def full_state_breakdown(cfg: MoEConfig, ep_size: int, rows: int) -> tuple[TensorBytes, ...]:
    """State a saved layer keeps for backward on a rank that received ``rows`` rows.

    bf16 (h2 is never kept: backward rebuilds it from h1)::

        x_gathered  [R, D]     bf16    align128(R*D*2)
        h1          [R, 2F]    bf16    align128(R*2F*2)
        h3_routes   [T, K, D]  bf16    align128(T*K*D*2)   (for the score gradients)

    (The bf16 backward computes the score gradients on the expert side and reads no h3; the
    model keeps these bytes unless ``cfg.save_route_outputs`` is False, which leaves
    ``h3_routes`` out, see docs/memory.md.)

    mxfp8 (column bundles feed WGRAD; the row bundles stay temporary)::

        x_col.qdata   [D, Rp]      e4m3   align128(Rp*D)
        x_col.scale   [D, Rp/32]   e8m0   align128(Rp*D/32)
        h1            [Rp, 2F]     bf16   align128(Rp*2F*2)
        h2_col.qdata  [F, Rp]      e4m3   align128(Rp*F)
        h2_col.scale  [F, Rp/32]   e8m0   align128(Rp*F/32)
        h3_routes     [T, K, D]    bf16   align128(T*K*D*2)

    With ``cfg.save_gathered_rows`` False the gathered rows (``x_gathered``, or mxfp8's
    ``x_col`` bundle) give way to the layer's input ``x [T, D]`` bf16, ``align128(T*D*2)``,
    which the backward gathers again (docs/memory.md). With ``"auto"`` this is the state
    with the rows; :func:`kept_x_state_bytes` is the other one.

    Inference keeps nothing.
    """
    if not cfg.training:
        return ()
    t, d, f, k = cfg.max_tokens, cfg.hidden, cfg.ffn, cfg.top_k
    h3 = (tensor_bytes("h3_routes", (t, k, d), "bf16"),) if cfg.save_route_outputs else ()
    kept_x = input_breakdown(cfg) if cfg.save_gathered_rows is False else ()
    if cfg.precision == "bf16":
        return (
            *(kept_x or (tensor_bytes("x_gathered", (rows, d), "bf16"),)),
            tensor_bytes("h1", (rows, 2 * f), "bf16"),
            *h3,
        )
    rp = padded_rows(cfg, ep_size, rows)
    return (
        *(kept_x or _mx_col_bundle("x_col", rp, d, *fp8_format(cfg))),
        tensor_bytes("h1", (rp, 2 * f), "bf16"),
        *_mx_col_bundle("h2_col", rp, f, *fp8_format(cfg)),
        *h3,
    )


def forward_scratch_layout(cfg: MoEConfig, ep_size: int, rows: int) -> ScratchLayout:
    """Forward temporaries with the state omitted (a replayed layer, or inference).

    bf16, ``2R(D + 3F)`` bytes before alignment::

        x_gathered [R, D] bf16,  h1 [R, 2F] bf16,  h2 [R, F] bf16

    mxfp8::

        x_row.qdata [Rp, D] e4m3, x_row.scale [Rp, D/32] e8m0,  h1 [Rp, 2F] bf16,
        h2_row.qdata [Rp, F] e4m3, h2_row.scale [Rp, F/32] e8m0

    nvfp4 (the source rank packs x, the expert rank gathers the packed rows)::

        x_row.qdata [Rp, D/2] e2m1x2, x_row.scale [Rp, D/16] e4m3, x_row.global_scale [Rp] fp32,
        h1 [Rp, 2F] bf16,
        h2_row.qdata [Rp, F/2] e2m1x2, h2_row.scale [Rp, F/16] e4m3, h2_row.global_scale [Rp] fp32

    h1 is a dense bf16 region in every precision so that the staged path (W13, then
    SwiGLU + W2) fits; a saved layer writes x and h1 to its slot instead.
    """
    d, f = cfg.hidden, cfg.ffn
    if cfg.precision == "bf16":
        resident = (
            tensor_bytes("x_gathered", (rows, d), "bf16"),
            tensor_bytes("h1", (rows, 2 * f), "bf16"),
            tensor_bytes("h2", (rows, f), "bf16"),
        )
    else:
        rp = padded_rows(cfg, ep_size, rows)
        if cfg.precision == "nvfp4":
            bundles = (_nvfp4_row_bundle("x_row", rp, d), _nvfp4_row_bundle("h2_row", rp, f))
        else:
            bundles = (_mx_row_bundle("x_row", rp, d, *fp8_format(cfg)),
                       _mx_row_bundle("h2_row", rp, f, *fp8_format(cfg)))
        resident = (
            *bundles[0],
            tensor_bytes("h1", (rp, 2 * f), "bf16"),
            *bundles[1],
        )
    return ScratchLayout(name="forward", resident=resident)


def backward_scratch_layout(cfg: MoEConfig, ep_size: int, rows: int) -> ScratchLayout | None:
    """Backward temporaries of a replayed layer (``None`` for inference).

    bf16: resident ``x_gathered [R, D]``, ``h1 [R, 2F]``, ``grad_h2 [R, F]``; one shared
    interval holds first ``h2 [R, F]`` + gathered ``grad_h3 [R, D]`` and then ``grad_h1
    [R, 2F]`` (written after both were read). Peak::

        D <= F:  2R(D + 5F)                 (grad_h1 is the larger tenant)
        D >  F:  2R(D + 5F) + 2R(D - F)     (h2 + grad_h3 is; the extra region is grad_h3's)

    before alignment; the code aligns each tensor and takes the max of the two tenants.
    Where the rows are read in place (:func:`rows_in_place`), ``x_gathered`` is not there:
    ``2RD`` less.

    mxfp8: resident ``x_col`` bundle [Rp, D], ``h1 [Rp, 2F] bf16``, ``grad_h2 [Rp, F] bf16``;
    the shared interval holds in turn: the ``x_row`` bundle (only while W13 rebuilds h1),
    then the ``h2_col``, ``grad_h3_row`` and ``grad_h3_col`` bundles (W2 DGRAD/WGRAD), then
    the ``grad_h1_row`` and ``grad_h1_col`` bundles (W13 DGRAD/WGRAD). Gathers quantise on
    the fly, so no bf16 copy of gathered x or grad_h3 exists.
    """
    if not cfg.training:
        return None
    d, f = cfg.hidden, cfg.ffn
    if cfg.precision == "bf16":
        # rows read in place (rows_in_place): no gathered copy of x
        gathered = () if rows_in_place(cfg, ep_size) else (
            tensor_bytes("x_gathered", (rows, d), "bf16"),)
        return ScratchLayout(
            name="backward replay",
            resident=(
                *gathered,
                tensor_bytes("h1", (rows, 2 * f), "bf16"),
                tensor_bytes("grad_h2", (rows, f), "bf16"),
            ),
            phases=(
                (
                    tensor_bytes("h2", (rows, f), "bf16"),
                    tensor_bytes("grad_h3", (rows, d), "bf16"),
                ),
                (tensor_bytes("grad_h1", (rows, 2 * f), "bf16"),),
            ),
        )
    rp = padded_rows(cfg, ep_size, rows)
    return ScratchLayout(
        name="backward replay",
        resident=(
            *_mx_col_bundle("x_col", rp, d, *fp8_format(cfg)),
            tensor_bytes("h1", (rp, 2 * f), "bf16"),
            tensor_bytes("grad_h2", (rp, f), "bf16"),
        ),
        phases=(
            _mx_row_bundle("x_row", rp, d, *fp8_format(cfg)),
            (
                *_mx_col_bundle("h2_col", rp, f, *fp8_format(cfg)),
                *_mx_row_bundle("grad_h3_row", rp, d, *fp8_format(cfg)),
                *_mx_col_bundle("grad_h3_col", rp, d, *fp8_format(cfg)),
            ),
            (
                *_mx_row_bundle("grad_h1_row", rp, 2 * f, *fp8_format(cfg)),
                *_mx_col_bundle("grad_h1_col", rp, 2 * f, *fp8_format(cfg)),
            ),
        ),
    )


def layer_costs(cfg: MoEConfig, ep_size: int, rows: int) -> LayerCosts:
    """All byte costs of one layer on a rank that received ``rows`` rows (validated)."""
    cfg.check_ep_size(ep_size)
    if isinstance(rows, bool) or not isinstance(rows, int):
        raise TypeError(f"rows must be an int, got {type(rows).__name__} ({rows!r})")
    if rows < 0:
        raise ValueError(f"rows ({rows}) must be >= 0")
    return LayerCosts(
        rows=rows,
        padded_rows=padded_rows(cfg, ep_size, rows),
        input=input_breakdown(cfg),
        full_state=full_state_breakdown(cfg, ep_size, rows),
        forward_scratch=forward_scratch_layout(cfg, ep_size, rows),
        backward_scratch=backward_scratch_layout(cfg, ep_size, rows),
    )


def input_bytes(cfg: MoEConfig) -> int:
    """Bytes a replayed layer keeps: ``align128(T * D * 2)`` in training, 0 in inference."""
    return total_bytes(input_breakdown(cfg))


def full_state_bytes(cfg: MoEConfig, ep_size: int, rows: int) -> int:
    """Bytes a saved layer keeps on a rank that received ``rows`` rows (see
    :func:`full_state_breakdown`)."""
    return total_bytes(full_state_breakdown(cfg, ep_size, rows))


def kept_x_state_bytes(cfg: MoEConfig, ep_size: int, rows: int) -> int:
    """Bytes a saved layer keeps where it keeps its input x instead of its gathered rows
    (``cfg.save_gathered_rows`` False, or a layer's choice under ``"auto"``)."""
    return full_state_bytes(replace(cfg, save_gathered_rows=False), ep_size, rows)


def scratch_bytes(cfg: MoEConfig, ep_size: int, rows: int) -> int:
    """Peak scratch of one call at ``rows`` received rows (forward and backward replay)."""
    return layer_costs(cfg, ep_size, rows).scratch_bytes
