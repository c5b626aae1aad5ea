"""SM clock and board power of a GPU while a benchmark's timed windows run.

Why: a Hopper GPU running a large MoE layer sits at its power limit, and the SM clock is whatever that limit leaves. A kernel that keeps the tensor
cores busier then lowers the clock for the whole step, so a kernel-level gain can all but
vanish at the layer. Reading the clock and power beside every timing tells such a case from a
change that did nothing.

:class:`GpuTelemetry` polls ``nvidia-smi --query-gpu=clocks.sm,power.draw -lms 50`` in a child
process for the duration of a ``with`` block and summarises the samples as medians. The SM
clock is an instantaneous reading; ``power.draw`` is on recent drivers an average over about
a second, so for a case whose timed windows last about a second or less it includes the
gaps between windows and reads low. Where
there is no ``nvidia-smi`` (CPU machines, other vendors) it records nothing and
:meth:`GpuTelemetry.summary` returns ``None``: telemetry never fails a benchmark.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["GpuTelemetry", "Telemetry", "parse_samples", "smi_id"]

#: polling period of nvidia-smi in milliseconds
PERIOD_MS = 50


@dataclass(frozen=True)
class Telemetry:
    """Medians over the samples taken while the block ran.

    Attributes:
        sm_clock_mhz: SM clock, MHz.
        power_w: board power draw, W.
        samples: how many samples the medians are over (a window shorter than the polling
            period may give one or none).
    """

    sm_clock_mhz: float
    power_w: float
    samples: int


def parse_samples(lines: Iterable[str]) -> list[tuple[float, float]]:
    """``(sm_clock_mhz, power_w)`` of every well-formed ``"clock, power"`` line of
    ``nvidia-smi --format=csv,noheader,nounits`` output; lines with ``[N/A]``, errors or
    anything else are skipped."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            out.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return out


def smi_id(device: torch.device) -> str:
    """The ``nvidia-smi --id`` of a CUDA device: its UUID where torch reports one (immune to
    ``CUDA_VISIBLE_DEVICES`` renumbering), else the physical index that the visible-devices
    list maps it to, else torch's index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if uuid:
            return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    except Exception:  # older torch: no uuid attribute
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index < len(ids):
        return ids[index]
    return str(index)


class GpuTelemetry:
    """``with GpuTelemetry(device) as tel: ...`` then ``tel.summary()``.

    Args:
        device: the CUDA device to watch; anything else records nothing.
    """

    def __init__(self, device: torch.device | str | None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._proc: subprocess.Popen | None = None
        self._samples: list[tuple[float, float]] = []

    def __enter__(self) -> GpuTelemetry:
        self._samples = []
        exe = shutil.which("nvidia-smi")
        if exe is None or self.device is None or self.device.type != "cuda":
            return self
        try:
            self._proc = subprocess.Popen(
                [exe, f"--id={smi_id(self.device)}", "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", f"-lms={PERIOD_MS}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        self._samples = parse_samples((out or "").splitlines())

    def summary(self) -> Telemetry | None:
        """Medians of the samples, or ``None`` when there are none."""
        if not self._samples:
            return None
        return Telemetry(
            sm_clock_mhz=statistics.median(s[0] for s in self._samples),
            power_w=statistics.median(s[1] for s in self._samples),
            samples=len(self._samples),
        )
