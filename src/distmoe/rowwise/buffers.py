"""The heap buffers of the rowwise calls (:class:`Buffers`), one set per process group.

A collective constructor allocates, on every rank of the group, on one symmetric heap
(:func:`distmoe.runtime.create_heap`):

==================  =====================  ===================================================
heap buffer         shape, dtype           role
==================  =====================  ===================================================
``out``             bf16 ``[rows, hidden]``  destination of :func:`~distmoe.rowwise.dispatch_put`
``expert_out``      bf16 ``[rows, hidden]``  source of :func:`~distmoe.rowwise.combine_get`
``grad_out``        bf16 ``[rows, hidden]``  (``grad=True``) ``out``'s gradient, which the
                                             dispatch backward pulls
``grad_expert_out`` bf16 ``[rows, hidden]``  (``grad=True``) ``expert_out``'s gradient, which
                                             the combine backward pushes
==================  =====================  ===================================================

With ``scaled=True`` (MXFP8 rows, hidden a multiple of 32) also ``out_q`` / ``expert_out_q``
(float8_e4m3fn ``[rows, hidden]``) and ``out_s`` / ``expert_out_s`` (uint8 E8M0
``[rows, hidden/32]``): destination of :func:`~distmoe.rowwise.dispatch_put_scaled` and
source of :func:`~distmoe.rowwise.combine_get_scaled`.

Either of ``out`` / ``expert_out`` may serve as the PUT destination or the GET source; a call
finds its :class:`Buffers` from the tensor it is given. Device counters (local, int64) count
the bad routes this rank issued: :meth:`Buffers.stats` reads them.

Construction and :meth:`Buffers.close` are collective set-up steps (they synchronise);
:meth:`Buffers.barrier` is the heap's barrier (a device kernel on CUDA, no host
synchronisation).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from distmoe.runtime import create_heap
from distmoe.runtime.heap import Backend

#: names of the buffers a call may address, and of their gradient twins
BUFFER_NAMES = ("out", "expert_out")
#: the MXFP8 buffers of ``scaled=True``: per name, (qdata, scales)
SCALED_NAMES = {"out_q": "out_s", "expert_out_q": "expert_out_s"}
_OWNER_ATTR = "_distmoe_rowwise_owner"
_COUNTERS = ("bad_put_routes", "bad_get_routes")


class Buffers:
    """Heap buffers of the rowwise calls on every rank of ``group`` (*collective*).

    Args:
        group: the expert-parallel process group (``None``: the world group). Every rank of
            it constructs its ``Buffers`` with the same arguments, in the same order as any
            other heap objects on the group.
        rows: R, rows of each buffer (the capacity a rank receives into), an int >= 1.
        hidden: D, the row width in elements, an int >= 1.
        dtype: the row dtype: ``torch.bfloat16`` (the only one so far; the scaled MXFP8
            forms come with their own buffers).
        device: this rank's device (default: the current CUDA device, or the CPU without
            CUDA).
        backend: the heap backend (``"auto"``, ``"cpu"``, ``"cuda_ipc"``, ``"cuda_symm"``;
            :func:`distmoe.runtime.create_heap`).
        check: check route values on the host before every call (synchronises, and shares
            the outcome over the group so that every rank raises together): bad routes
            (rank >= world size, row >= rows) raise ``ValueError`` instead of being dropped
            and counted, and so does a differentiable call on some ranks but not others.
        grad: allocate the two gradient buffers that differentiable calls need (default
            True; ``False`` for inference only halves the heap).
        scaled: also allocate the MXFP8 buffers of the scaled calls (``hidden`` a multiple
            of 32): ``out_q`` / ``out_s`` and ``expert_out_q`` / ``expert_out_s``.

    Attributes:
        out: bf16 ``[rows, hidden]``, this rank's dispatch destination (heap memory).
        expert_out: bf16 ``[rows, hidden]``, this rank's combine source (heap memory).
        out_q / out_s, expert_out_q / expert_out_s: (``scaled=True``) float8_e4m3fn
            ``[rows, hidden]`` / uint8 ``[rows, hidden/32]``, the scaled calls' buffers.
        rank, world_size, rows, hidden, dtype, device, check, group, heap.

    Both buffers start zero-filled. Pass them whole (not a slice) to the calls; write expert
    results into them with :meth:`write` (autograd records it, and a step's graph is not
    chained to the previous step's).
    """

    def __init__(self, group: dist.ProcessGroup | None, rows: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 backend: Backend = "auto", check: bool = False, *, grad: bool = True,
                 scaled: bool = False) -> None:
        for name, value in (("rows", rows), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an int >= 1")
        if dtype != torch.bfloat16:
            raise ValueError(f"dtype ({dtype!r}) must be torch.bfloat16: the rowwise buffers "
                             "carry bf16 rows (the scaled MXFP8 forms are not built yet)")
        for name, value in (("check", check), ("grad", grad), ("scaled", scaled)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if scaled and hidden % 32:
            raise ValueError(f"hidden ({hidden}) must be a multiple of 32 with scaled=True (one "
                             "E8M0 scale per 32 values)")
        self._closed = False
        self.heap = create_heap(group, backend=backend, device=device)
        self.group = self.heap.group
        self.rank, self.world_size = self.heap.rank, self.heap.world_size
        self.device = self.heap.device
        self.rows, self.hidden, self.dtype = rows, hidden, dtype
        self.check, self.grad, self.scaled = check, grad, scaled
        self._tensors: dict[str, torch.Tensor] = {}
        names = BUFFER_NAMES + (tuple(f"grad_{n}" for n in BUFFER_NAMES) if grad else ())
        layouts = [(name, dtype, (rows, hidden), rows * hidden * 2) for name in names]
        if scaled:
            for q_name, s_name in SCALED_NAMES.items():
                layouts += [(q_name, torch.float8_e4m3fn, (rows, hidden), rows * hidden),
                            (s_name, torch.uint8, (rows, hidden // 32), rows * hidden // 32)]
        try:
            for name, view_dtype, shape, num_bytes in layouts:
                self.heap.allocate(name, num_bytes)
                # detach(): a fresh tensor over the heap memory, not an autograd view of the
                # uint8 segment (autograd would route in-place history to that base and lose
                # it)
                tensor = self.heap.view(name, self.rank, view_dtype, shape).detach()
                setattr(tensor, _OWNER_ATTR, (weakref.ref(self), name))
                self._tensors[name] = tensor
        except BaseException:
            self.heap.close()
            raise
        self.out = self._tensors["out"]
        self.expert_out = self._tensors["expert_out"]
        if scaled:
            self.out_q, self.out_s = self._tensors["out_q"], self._tensors["out_s"]
            self.expert_out_q = self._tensors["expert_out_q"]
            self.expert_out_s = self._tensors["expert_out_s"]
        #: int64 [2] device counters: bad PUT routes, bad GET routes (issued by this rank)
        self._counters = torch.zeros(len(_COUNTERS), dtype=torch.int64, device=self.device)

    def write(self, name: str, rows: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Copy ``rows`` (``[n, hidden]``, any float dtype, rounded to bf16) into rows
        ``start .. start+n-1`` of this rank's buffer ``name`` (``"out"`` or
        ``"expert_out"``), recorded by autograd, and return the whole buffer: what a
        combine then reads, its gradient flowing back to ``rows``.

        The buffer's autograd history from an earlier step is dropped first. A plain
        ``bufs.expert_out[:n].copy_(h)`` in every training step would chain each step's
        graph to the one before (and the next backward would run into the freed one).
        Local only: call a barrier (the combine's ``pre_barrier``) before peers read it.
        """
        self.check_open()
        if name not in BUFFER_NAMES:
            raise ValueError(f"name ({name!r}) must be one of {list(BUFFER_NAMES)}")
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        if not rows.is_floating_point() or rows.dim() != 2 or rows.shape[1] != self.hidden:
            raise ValueError(f"rows must be a floating [n, hidden = {self.hidden}] tensor, got "
                             f"{rows.dtype} of shape {list(rows.shape)}")
        if isinstance(start, bool) or not isinstance(start, int) or not (
                0 <= start <= self.rows - rows.shape[0]):
            raise ValueError(f"start ({start!r}) must be an int with 0 <= start and start + "
                             f"{rows.shape[0]} rows <= rows ({self.rows})")
        if rows.device != self.device:
            raise ValueError(f"rows must be on the Buffers' device ({self.device}), got "
                             f"{rows.device}")
        buf = self._tensors[name]
        if buf.requires_grad:
            buf.detach_()
        buf[start:start + rows.shape[0]].copy_(rows)
        return buf

    # ------------------------------------------------------------------ what calls use
    def bases(self, name: str) -> torch.Tensor:
        """int64 ``[world_size]`` on this rank's device: row 0 of buffer ``name`` on every
        rank, as mapped in this process (what the kernels address)."""
        self.check_open()
        return self.heap.base_table(name)

    def grad_buffer(self, name: str) -> torch.Tensor:
        """This rank's gradient twin of buffer ``name`` (bf16 ``[rows, hidden]``)."""
        self.check_open()
        if not self.grad:
            raise RuntimeError("these Buffers were built with grad=False: no gradient "
                               "buffers for a backward")
        return self._tensors[f"grad_{name}"]

    def counter(self, kind: str) -> torch.Tensor:
        """int64 ``[1]`` device counter of bad routes, ``kind`` ``"put"`` or ``"get"``."""
        index = _COUNTERS.index(f"bad_{kind}_routes")
        return self._counters[index:index + 1]

    def barrier(self) -> None:
        """*Collective.* The heap's barrier: every rank's writes issued before it (to its own
        or peers' buffers) are visible to every rank after it. On CUDA a stream-ordered
        device kernel, no host synchronisation."""
        self.check_open()
        self.heap.barrier()

    # ------------------------------------------------------------------ stats and lifetime
    def stats(self) -> dict:
        """Counters of this rank (reads device memory: synchronises; not for the hot path).

        Returns a dict: ``rank``, ``world_size``, ``rows``, ``hidden``, ``heap_bytes`` (this
        rank's heap buffers), ``bad_put_routes`` / ``bad_get_routes`` (routes this rank
        issued with a rank >= world_size or a row >= rows, dropped; summed over calls,
        forward calls only: a backward replays its forward's routes and does not count them
        again).
        """
        self.check_open()
        counts = dict(zip(_COUNTERS, (int(v) for v in self._counters.tolist()), strict=True))
        return dict(rank=self.rank, world_size=self.world_size, rows=self.rows,
                    hidden=self.hidden, heap_bytes=sum(self.heap.size(n) for n in self.heap.names),
                    **counts)

    def close(self) -> None:
        """*Collective.* Free the heap buffers (idempotent); ``out`` / ``expert_out`` must not
        be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._tensors.clear()
        self.heap.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        """RuntimeError if these Buffers are closed."""
        if self._closed:
            raise RuntimeError("these distmoe.rowwise.Buffers are closed")

    def __enter__(self) -> Buffers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"rank {self.rank} of {self.world_size}"
        return (f"Buffers(rows={self.rows}, hidden={self.hidden}, dtype={self.dtype}, "
                f"device={self.device}, {state})")


def scaled_buffer_of(arg_name: str, value: object) -> tuple[Buffers, str, str]:
    """``(Buffers, qdata buffer name, scale buffer name)`` that tensor ``value`` (argument
    ``arg_name``) is: the ``.out_q`` or ``.expert_out_q`` of open ``Buffers(scaled=True)``,
    whole; ``TypeError``/``ValueError`` naming the argument otherwise."""
    owner = getattr(value, _OWNER_ATTR, None) if isinstance(value, torch.Tensor) else None
    bufs = owner[0]() if owner is not None else None
    if owner is None or bufs is None or owner[1] not in SCALED_NAMES:
        got = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise ValueError(f"{arg_name} must be the .out_q or .expert_out_q tensor of a "
                         f"distmoe.rowwise.Buffers(scaled=True), whole, got {got}")
    if bufs.closed:
        raise RuntimeError(f"{arg_name} belongs to distmoe.rowwise.Buffers that are closed")
    return bufs, owner[1], SCALED_NAMES[owner[1]]


def buffer_of(arg_name: str, value: object) -> tuple[Buffers, str]:
    """``(Buffers, buffer name)`` that tensor ``value`` (argument ``arg_name``) is; raises
    ``TypeError``/``ValueError`` naming the argument when it is not a whole buffer of open
    :class:`Buffers`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{arg_name} must be a torch.Tensor (the .out or .expert_out of a "
                        f"distmoe.rowwise.Buffers), got {type(value).__name__}")
    owner = getattr(value, _OWNER_ATTR, None)
    bufs = owner[0]() if owner is not None else None
    if owner is None or bufs is None or owner[1] not in BUFFER_NAMES:
        raise ValueError(f"{arg_name} must be the .out or .expert_out tensor of a "
                         "distmoe.rowwise.Buffers, whole (not a slice or a copy: peers address "
                         f"it through the heap), got a tensor of shape {list(value.shape)}")
    if bufs.closed:
        raise RuntimeError(f"{arg_name} belongs to distmoe.rowwise.Buffers that are closed")
    return bufs, owner[1]
