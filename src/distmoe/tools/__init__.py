"""The commands of ``python -m distmoe`` and what they share.

* ``demo`` (:mod:`.demo`): run the layer here and check it against the reference;
* ``plan`` (:mod:`.plan_cli`): the activation-memory plan, or the kernel plan;
* ``bench`` (:mod:`.bench`): the benchmark suite against the torch baseline and ceilings;
* ``ab`` (:mod:`.ab`, :mod:`.budget`): layer A/B of kernel-plan variants or memory budgets;
* ``profile`` (:mod:`.profile`, :mod:`.ncu_stalls`, :mod:`.ptxas`): one layer step under
  torch.profiler, trace timelines, Nsight Compute stall tables, sm_90 register reports;
* ``tune`` (:mod:`.tune`): launch-config sweeps of one kernel.

:mod:`.sm90_build` builds kernels for sm_90 without a GPU (``profile --ptxas``).
"""

from __future__ import annotations

from collections.abc import Callable

#: The note a command prints under times measured on the CPU.
INTERPRETER_NOTE = ("these are CPU times: distmoe's kernels ran in Triton's interpreter (and "
                    "torch's ops on the CPU), so they say nothing about GPU speed")


def require_cuda(prog: str) -> None:
    """Exit with status 2 and a one-line message when this process sees no CUDA GPU: for the
    GPU-only commands (measurements of GPU kernels, nothing to do on a CPU)."""
    import sys

    import torch

    if not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU (torch sees none in this process)",
              file=sys.stderr)
        raise SystemExit(2)


def quiet_on_closed_pipe(main: Callable[[], int]) -> int:
    """``main()``'s exit status, its buffered output flushed; or, when the reader of stdout
    went away (``distmoe plan | head -1``), status 141 without a traceback, stdout pointed at
    /dev/null so that the interpreter's last flush does not fail again. 141 = 128 + SIGPIPE,
    what the shell reports for a Unix tool that the closed pipe ended (``yes | head -1``);
    it also keeps a cut-off run apart from bench's "no case succeeded" (1) and from a usage
    error (2)."""
    import os
    import sys

    try:
        status = main()
        sys.stdout.flush()  # what is still buffered fails here, not at interpreter exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return status


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
