"""CPU execution of the Triton kernels through Triton's interpreter.

Machines without a CUDA device run every kernel with ``TRITON_INTERPRET=1``.
:func:`use_interpreter_if_no_gpu` turns that on (before any kernel module is imported) and
applies :func:`patch_interpreter_bf16_dot`.

Known defects in Triton 3.6's interpreter, both corrected here:

* bfloat16 values are held as raw ``uint16`` numpy arrays (numpy has no bfloat16), and
  ``tl.dot`` multiplies those integers as if they were numbers. The patch widens bf16 operands
  to float32 bit-exactly (bf16 is the top half of an fp32 word) before the matmul.
* fp32 -> bf16 casts truncate (and its explicit round-to-nearest path drops the carry into the
  exponent), while the GPU rounds to nearest even. The patch rounds through torch, which
  rounds to nearest even like the hardware.

What the GPU kernel computes is unchanged; only the interpreter's emulation is corrected.
"""

from __future__ import annotations

import os

import numpy as np

_PATCHED = False


def interpreter_active() -> bool:
    """True when Triton kernels run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter_bf16_dot() -> None:
    """Make ``tl.dot`` on bf16 operands correct in Triton's interpreter (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = _widen_bf16(a, interp, tl)
            b = _widen_bf16(b, interp, tl)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot

    original_cast = interp.InterpreterBuilder.cast_impl
    original_fp_to_fp = interp.InterpreterBuilder.create_fp_to_fp

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64):
            return _round_to_bf16(src, interp, tl)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        rtz = rounding_mode is not None and "RTZ" in str(rounding_mode)
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64) \
                and not rtz:
            return _round_to_bf16(src, interp, tl)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    interp.InterpreterBuilder.cast_impl = cast_impl
    interp.InterpreterBuilder.create_fp_trunc = cast_impl
    interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    _PATCHED = True


def _round_to_bf16(handle, interp, tl):
    import torch

    wide = torch.from_numpy(np.ascontiguousarray(handle.data, dtype=np.float32))
    bits = wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return interp.TensorHandle(bits.reshape(handle.data.shape), tl.bfloat16)


def _widen_bf16(handle, interp, tl):
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    widened = (handle.data.astype(np.uint32) << 16).view(np.float32)
    return interp.TensorHandle(widened, tl.float32)


def use_interpreter_if_no_gpu() -> bool:
    """Select the interpreter when no CUDA device is present; returns whether it is active.

    Must run before the kernel modules are imported (``triton.jit`` reads the switch when a
    kernel is defined). An explicit ``TRITON_INTERPRET`` in the environment is respected.
    """
    import torch

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    if interpreter_active():
        patch_interpreter_bf16_dot()
        return True
    return False
