"""Command-line tools: the benchmark harness, the memory planner CLI, the demo, sm_90 builds."""

from __future__ import annotations


def require_cuda(prog: str) -> None:
    """Exit with status 2 and a one-line message when this process sees no CUDA GPU: for the
    GPU-only scripts in ``tools/`` (measurements of GPU kernels, nothing to do on a CPU)."""
    import sys

    import torch

    if not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU (torch sees none in this process)",
              file=sys.stderr)
        raise SystemExit(2)


# The library names its arguments (MoEConfig fields, plan_memory's ep_size); the commands'
# users typed options (the same spelling in `distmoe plan` and `distmoe demo`).
_OPTION_OF = {
    "cfg.max_layers_per_slot": "--layers-per-slot",
    "max_layers_per_slot": "--layers-per-slot",
    "device_scratch_factor": "--device-scratch-factor",
    "total_scratch_factor": "--total-scratch-factor",
    "activation_factor": "--activation-factor",
    "activation_bytes": "--activation-bytes",
    "num_experts": "--experts",
    "max_tokens": "--tokens",
    "num_slots": "--slots",
    "row_block": "--row-block",
    "precision": "--precision",
    "ep_size": "--ep",
    "hidden": "--hidden",
    "top_k": "--top-k",
    "ffn": "--ffn",
}


def with_options(message: str) -> str:
    """An error ``message`` of the library with its field names replaced by the command-line
    options that set them."""
    import re

    field = re.compile(
        r"(?<![\w.\-])(" + "|".join(re.escape(k) for k in _OPTION_OF) + r")(?![\w\-])")
    return field.sub(lambda m: _OPTION_OF[m.group(1)], message)
