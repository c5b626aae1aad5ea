"""distmoe: distributed Mixture-of-Experts expert MLPs for NVIDIA Hopper GPUs.

Public API (README.md; the architecture: docs/design.md): :class:`MoEConfig`,
:func:`plan_memory`, :class:`MoEContext`, :func:`launch`, the reference in
:mod:`distmoe.reference`, modules in :mod:`distmoe.nn` and the rowwise PUT/GET API in
:mod:`distmoe.rowwise`.
"""

from .kernels.base.interpreter import use_interpreter_if_no_gpu

# On a machine without CUDA, Triton kernels run through the interpreter (with its bf16 tl.dot
# corrected); this must happen before any kernel module is imported.
use_interpreter_if_no_gpu()

from . import nn as nn  # noqa: E402  (distmoe.nn: modules that hold parameters)
from . import rowwise as rowwise  # noqa: E402  (the lower-level PUT/GET API)
from .config import MoEConfig  # noqa: E402
from .launch import launch  # noqa: E402
from .memory import MemoryPlan, plan_memory  # noqa: E402
from .ops import MoEContext  # noqa: E402
from .quant import PreparedWeight, prepare_weights  # noqa: E402  (low-precision weights)
from .rowwise import grouped_mm, scaled_grouped_mm_q  # noqa: E402  (torch._grouped_mm-style)

__version__ = "0.1.0"

__all__ = ["MemoryPlan", "MoEConfig", "MoEContext", "PreparedWeight", "grouped_mm", "launch",
           "plan_memory", "prepare_weights", "scaled_grouped_mm_q", "__version__"]
