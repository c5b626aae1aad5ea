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
