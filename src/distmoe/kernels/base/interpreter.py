"""CPU execution of the Triton kernels through Triton's interpreter.

Machines without a CUDA device run every kernel with ``TRITON_INTERPRET=1``.
:func:`use_interpreter_if_no_gpu` turns that on (before any kernel module is imported) and
applies :func:`patch_interpreter_bf16_dot` and :func:`patch_interpreter_nested_calls`.

Known defects in Triton 3.6's interpreter, both corrected here:

* bfloat16 values are held as raw ``uint16`` numpy arrays (numpy has no bfloat16), and
  ``tl.dot`` multiplies those integers as if they were numbers. The patch widens bf16 operands
  to float32 bit-exactly (bf16 is the top half of an fp32 word) before the matmul.
* fp32 -> bf16 casts truncate (and its explicit round-to-nearest path drops the carry into the
  exponent), while the GPU rounds to nearest even. The patch rounds through torch, which
  rounds to nearest even like the hardware.

What the GPU kernel computes is unchanged; only the interpreter's emulation is corrected.

Two costs are cut as well, with the same results (:func:`patch_interpreter_nested_calls`):

* the interpreter patches ``triton.language`` again at every call of a ``@triton.jit``
  function from inside a kernel (``tl.sort``'s network alone makes thousands), which finds
  nothing left to patch but costs a large share of a small layer forward on the CPU;
* ``tl.xor_sum`` (in every compare-and-swap step of ``tl.sort``) falls to the interpreter's
  element-by-element Python reduction; the patch makes it one numpy ``bitwise_xor``
  reduction, as sums already are;
* the numpy dtype of a Triton type is looked up once per type instead of rebuilding the
  interpreter's table at every load, store and cast.
"""

from __future__ import annotations

import inspect
import os

import numpy as np

_PATCHED = False
_NESTED_PATCHED = False


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


class _KeptScope:
    """What a skipped patch returns: nothing to restore (the kernel's own scope restores)."""

    def restore(self) -> None:
        pass


def patch_interpreter_nested_calls() -> None:
    """Skip the interpreter's language patch on a nested ``@triton.jit`` call when the
    running kernel already patched every ``triton.language`` module that function sees, and
    reduce ``tl.xor_sum`` with numpy (idempotent).

    Triton 3.6 patches ``tl`` / ``tl.core`` when a kernel starts (and restores them when it
    ends), and again at each device-function call inside it. The repeat finds the builtins
    already replaced, so it only walks the modules (``inspect.getmembers``) and re-sets the
    same tensor and reduce hooks; its scope is dropped unrestored. A function that sees a
    module the kernel has not patched yet (the standard library's ``core``, say) is still
    patched, once per kernel."""
    global _NESTED_PATCHED
    if _NESTED_PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original_patch = interp._patch_lang
    original_grid_call = interp.GridExecutor.__call__
    running = []  # one set per running kernel: ids of the language modules it patched
    kept = _KeptScope()

    seen: dict = {}  # function -> ids of the language modules its globals hold

    def _patch_lang(fn):
        langs = seen.get(fn)
        if langs is None:  # a module's imports do not change while kernels run
            langs = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (tl, tl.core))
        if running and langs <= running[-1]:
            return kept
        scope = original_patch(fn)
        if running:
            running[-1].update(langs)
        return scope

    def grid_call(self, *args, **kwargs):
        running.append(set())
        try:
            return original_grid_call(self, *args, **kwargs)
        finally:
            running.pop()

    # the numpy dtype of a Triton type: the interpreter builds a 20-entry dict on every
    # call (every load, store, cast and constant); the same answer, looked up once per type
    original_np_dtype = interp._get_np_dtype
    np_dtypes: dict = {}

    def _get_np_dtype(tt_dtype):
        try:
            return np_dtypes[tt_dtype]
        except KeyError:
            value = np_dtypes[tt_dtype] = original_np_dtype(tt_dtype)
            return value
        except TypeError:  # an unhashable type: not cached
            return original_np_dtype(tt_dtype)

    interp._get_np_dtype = _get_np_dtype

    original_reduce = interp.ReduceOps.apply_impl

    def apply_impl(self, input):
        if self.combine_fn == tl.standard._xor_combine:
            data = input[0].handle.data
            xor = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(xor, input[0].dtype)
        return original_reduce(self, input)

    interp._patch_lang = _patch_lang
    interp.GridExecutor.__call__ = grid_call
    interp.ReduceOps.apply_impl = apply_impl
    _NESTED_PATCHED = True


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
        patch_interpreter_nested_calls()
        return True
    return False
