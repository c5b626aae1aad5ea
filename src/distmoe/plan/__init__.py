"""The kernel plan: which kernel and launch config every GEMM and data-movement step of a layer
uses, decided in one place from the layer's shape, its configured bounds, the device class and
the mode.

* :mod:`distmoe.plan.thresholds`: the numbers, one table per device class, each with its
  reason and evidence;
* :mod:`distmoe.plan.rules`: one rule per GEMM family and the per-call layer rules;
* :mod:`distmoe.plan.kernel_plan`: :class:`KernelPlan`, :func:`plan_kernels` and overrides.

``MoEContext`` plans once at construction (``ctx.plan``; ``ctx.explain(tokens)`` prints it);
``python -m distmoe plan --kernels`` prints a plan without a GPU.
"""

from .kernel_plan import (
    KERNELS,
    LAYER_SWITCHES,
    KernelPlan,
    LayerSwitches,
    apply_overrides,
    device_class,
    plan_kernels,
)
from .thresholds import DEVICE_CLASSES, DeviceClass, Thresholds, thresholds

__all__ = [
    "DEVICE_CLASSES",
    "KERNELS",
    "LAYER_SWITCHES",
    "DeviceClass",
    "KernelPlan",
    "LayerSwitches",
    "Thresholds",
    "apply_overrides",
    "device_class",
    "plan_kernels",
    "thresholds",
]
