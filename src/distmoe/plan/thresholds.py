"""The thresholds of the kernel plan, one table per device class.

Every number that decides which kernel or launch config a call uses sits in one row here,
with a one-line reason and a pointer to the measurement it rests on (an anchor in
docs/performance.md). The rules that read them are in :mod:`distmoe.plan.rules`.

Device classes (:func:`device_class`):

* ``"h100"``: compute capability 9.x with under :data:`HBM3E_MEMORY_BYTES` of memory
  (H100 SXM / PCIe, 80 GB of HBM3 at about 3.35 TB/s). Parts between (H20, H100 NVL) take
  this table: unmeasured.
* ``"h200"``: compute capability 9.x with at least that much memory (H200 141 GB, GH200
  144 GB of HBM3e at about 4.8 TB/s): memory size stands in for DRAM bandwidth, which torch
  does not report.
* ``"generic"``: every other device (CPU through Triton's interpreter, CUDA devices other
  than Hopper): the Triton kernels only, so no Gluon row applies.

Rows per expert ("rows" below) always means the plan's shape key ``T_max * K / E_local``,
a configured bound, never a routed count.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

DeviceClass = Literal["h100", "h200", "generic"]
DEVICE_CLASSES: tuple[DeviceClass, ...] = ("h100", "h200", "generic")

#: Device memory from which a compute-capability-9 GPU counts as ``"h200"`` (HBM3e class):
#: between the H100's 80 GB (torch reports 79.6 GiB) and the H200's 141 GB (140.4 GiB).
HBM3E_MEMORY_BYTES = 120 * 1024**3

_GIB = 1024**3
_MIB = 1024**2


@dataclass(frozen=True)
class Row:
    """One threshold: its value, why it is there (one line) and the evidence."""

    value: object
    reason: str
    evidence: str


def _row(value, reason: str, run: str) -> Row:
    return Row(value, reason, f"docs/performance.md#{run}")


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """The thresholds of one device class (each field a :class:`Row`; ``t.value(name)``
    reads the value)."""

    gluon_mid_rows_weight_bytes: Row
    lockstep_rows: Row
    lockstep_w2_weight_bytes: Row
    lockstep_w2_dgrad_rows: Row
    lockstep_w2_dgrad_weight_bytes: Row
    expert_groups_w2_rows: Row
    expert_groups_w13_dgrad_rows: Row
    expert_groups_w2_dgrad_rows: Row
    gluon_w13_dgrad_expert_bytes: Row
    wgrad_wide_tile_expert_bytes: Row
    wgrad_lockstep_expert_bytes: Row
    wgrad_wide_tile_min_rows: Row
    long_segment_rows: Row
    pull_all_fraction: Row
    w13_phases_min_own_rows: Row
    fp4_swap_rows: Row
    fp4_fp8_min_rows: Row

    def value(self, name: str):
        """The value of threshold ``name``."""
        return getattr(self, name).value

    def rows(self) -> list[tuple[str, Row]]:
        """(name, row) in declaration order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


_H100 = Thresholds(
    gluon_mid_rows_weight_bytes=_row(
        2 * _GIB,
        "Gluon forwards at 64-127 rows only while the kernel's weights on the rank stay "
        "under this: they gain where weights are small, not where streaming them dominates",
        "run-38"),
    lockstep_rows=_row(
        (128, 192),
        "Gluon W13/W2 forward producers in lockstep on [lo, hi) rows: a router's histogram "
        "leaves half the experts a nearly empty second block there",
        "run-52"),
    lockstep_w2_weight_bytes=_row(
        8 * _MIB,
        "W2 forward lockstep only where one expert's W2 weights hold this much: small "
        "experts' tiles stay in L2 without it",
        "run-52"),
    lockstep_w2_dgrad_rows=_row(
        (96, 192),
        "Gluon W2 DGRAD producer in lockstep on [lo, hi) rows (with the weight bound below)",
        "run-53"),
    lockstep_w2_dgrad_weight_bytes=_row(
        3 * _GIB,
        "W2 DGRAD lockstep only where the rank's W2 weights total this much: it loses on "
        "small weights",
        "run-53"),
    expert_groups_w2_rows=_row(
        (128, 1024),
        "Gluon W2 forward walks tiles expert by expert on [lo, hi] rows at EP=1: a row "
        "block's h2 rows stay in L2 across its column tiles; slower on longer segments",
        "run-59"),
    expert_groups_w13_dgrad_rows=_row(
        (128, 512),
        "Gluon W13 DGRAD expert-group order on [lo, hi] rows; even to slower above",
        "run-60"),
    expert_groups_w2_dgrad_rows=_row(
        (16, 768),
        "Gluon W2 DGRAD expert-group order on [lo, hi] rows; slower from 1024 rows",
        "run-62"),
    gluon_w13_dgrad_expert_bytes=_row(
        32 * _MIB,
        "Gluon W13 DGRAD only where one expert's W13 weights are at most this: larger "
        "experts ran slower on it",
        "run-44"),
    wgrad_wide_tile_expert_bytes=_row(
        12 * _MIB,
        "WGRAD takes 256 x 128 tiles from this much gradient per expert: B rows loaded "
        "once per 256 output rows; small experts lose the wave balance",
        "run-54"),
    wgrad_lockstep_expert_bytes=_row(
        48 * _MIB,
        "WGRAD 256 x 128 tiles in lockstep from this much gradient per expert: an expert "
        "that outgrows the 50 MB L2 evicts its own rows before lagging programs read them",
        "run-55"),
    wgrad_wide_tile_min_rows=_row(
        0,
        "rows from which the WGRAD's 256 x 128 tiles may be taken (no bound on HBM3)",
        "run-54"),
    long_segment_rows=_row(
        1024,
        "rows from which expert segments count as long: fewer stages, TMA epilogue in "
        "inference, ping-pong W13 tiles in inference, cooperative WGRAD warpgroups",
        "run-19"),
    pull_all_fraction=_row(
        0.9,
        "EP > 1 copies every peer token (copy engines, beside the routing) where at least "
        "this fraction of the copy is expected to be used",
        "run-30"),
    w13_phases_min_own_rows=_row(
        1024,
        "W13 in two launches around the peer copy from this many rows per local expert "
        "from one source rank: own blocks share weight tiles with the rest",
        "run-32"),
    fp4_swap_rows=_row(
        32,
        "FP4-weight GEMMs below this many rows per expert compute transposed tiles of 32 "
        "token rows (decoded weights as the MMA's M side) instead of 128-row tiles: faster "
        "at decode, slightly slower at prefill (the line between not measured: where one "
        "transposed tile holds an expert's rows)",
        "run-76"),
    fp4_fp8_min_rows=_row(
        2**31,
        "FP4-weight layers from this many rows per expert run on FP8 operands; never: the "
        "bf16 operands were faster at the layer and at the GEMM, at decode and prefill",
        "run-76"),
)

_TABLES: dict[str, Thresholds] = {
    "h100": _H100,
    # The H200 differs in one row: its faster DRAM makes the WGRAD's ping-pong 128 x 128
    # tiles win below 1024 rows per expert.
    "h200": replace(_H100, wgrad_wide_tile_min_rows=_row(
        1024,
        "on HBM3e the WGRAD's ping-pong tiles beat 256 x 128 ones below this many rows; "
        "256 x 128 wins on long segments",
        "run-57")),
    # No Gluon kernel runs here; the rows that only pick Gluon options are unused.
    "generic": _H100,
}


def thresholds(device_class: DeviceClass) -> Thresholds:
    """The threshold table of ``device_class`` (ValueError for an unknown class)."""
    if device_class not in _TABLES:
        raise ValueError(f"device_class ({device_class!r}) must be one of {DEVICE_CLASSES}")
    return _TABLES[device_class]
