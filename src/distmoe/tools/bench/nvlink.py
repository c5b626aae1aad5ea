"""NVLink bytes measured on the GPU while the bench runs a case, beside the modelled ones
(:func:`distmoe.tools.bench.models.nvlink_bytes`).

Source: NVML's GPU performance monitoring (GPM, Hopper and later) through ``pynvml`` (the
``nvidia-ml-py`` package, in the ``tools`` extra): two GPM samples around a block of calls,
and the metrics ``NVLINK_TOTAL_TX_PER_SEC`` / ``NVLINK_TOTAL_RX_PER_SEC`` (MiB/s over every
link, averaged between the samples) times the elapsed time give the bytes this GPU sent and
received. Why GPM: it counts what crossed the links, whatever moved it (peer loads and
stores of the kernels, copy engines, NCCL), where the model counts routed rows only.

Not measured, with the reason said (:func:`open_counter`): without ``pynvml``, without an
NVML library (a CPU machine), with fewer than two visible GPUs (nothing crosses NVLink), on
a GPU without GPM support.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MIB = 1024 * 1024


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one call sent (``tx``) and received (``rx``) over all NVLinks of this GPU."""

    tx: float
    rx: float

    @property
    def per_direction(self) -> float:
        """The mean of the two directions (the model counts bytes per GPU and direction)."""
        return (self.tx + self.rx) / 2


class NvlinkCounter:
    """GPM samples of one GPU around blocks of calls (:func:`open_counter` makes one)."""

    def __init__(self, nvml, handle) -> None:
        self._nvml = nvml
        self._handle = handle

    def measure(self, fn: Callable[[], object], calls: int,
                device: torch.device) -> LinkBytes:
        """Run ``fn`` ``calls`` times between two GPM samples (synchronising before and
        after: a measurement, not the timed windows) and return the bytes per call."""
        nvml = self._nvml
        first, second = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
        try:
            torch.cuda.synchronize(device)
            nvml.nvmlGpmSampleGet(self._handle, first)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            nvml.nvmlGpmSampleGet(self._handle, second)
            get = nvml.c_nvmlGpmMetricsGet_t()
            get.version = nvml.NVML_GPM_METRICS_GET_VERSION
            get.numMetrics = 2
            get.sample1, get.sample2 = first, second
            get.metrics[0].metricId = nvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
            get.metrics[1].metricId = nvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
            nvml.nvmlGpmMetricsGet(get)
            for m in get.metrics[:2]:
                if m.nvmlReturn != 0:
                    raise RuntimeError(f"NVML GPM metric {m.metricId}: error {m.nvmlReturn}")
            tx, rx = (get.metrics[i].value * _MIB * seconds / calls for i in (0, 1))
        finally:
            nvml.nvmlGpmSampleFree(first)
            nvml.nvmlGpmSampleFree(second)
        return LinkBytes(tx=tx, rx=rx)


def open_counter(device: torch.device) -> tuple[NvlinkCounter | None, str]:
    """``(counter, "")`` for ``device``, or ``(None, why not)``."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, "needs a CUDA GPU"
    if torch.cuda.device_count() < 2:
        return None, "needs two visible GPUs (nothing crosses NVLink on one)"
    try:
        import pynvml as nvml
    except ImportError:
        return None, "needs pynvml (pip install nvidia-ml-py, in distmoe's tools extra)"
    try:
        nvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-")
                                                else "GPU-" + uuid)
        support = nvml.nvmlGpmQueryDeviceSupport(handle)
    except Exception as exc:  # NVML missing or refusing: the reason is the result
        return None, f"NVML: {type(exc).__name__}: {exc}"
    if not support.isSupportedDevice:
        return None, "this GPU does not support NVML GPM"
    return NvlinkCounter(nvml, handle), ""


_OPENED: dict = {}


def counter_for(device: torch.device) -> tuple[NvlinkCounter | None, str]:
    """:func:`open_counter`, once per device and process."""
    if device not in _OPENED:
        _OPENED[device] = open_counter(device)
    return _OPENED[device]
