"""The activation slot's save/replay decision for one layer, in one device program.

:meth:`distmoe.ops.activations.ActivationBuffer.begin_layer` evaluates, for the next layer of
a slot and on the device, the planner's rule over every rank's executed rows ``R_r``::

    full_r = align128(R_r*X_ROW_BYTES) + kept_x_bytes + align128(R_r*2F*2) + h3_bytes
    save   = max_r(cursor_r + full_r) + reserve <= slot_bytes

(``X_ROW_BYTES = 2D, kept_x_bytes = 0`` by default: a saved layer keeps its gathered rows;
``X_ROW_BYTES = 0, kept_x_bytes = input_bytes`` with ``MoEConfig.save_gathered_rows`` False:
it keeps its input x and its backward gathers the rows again.) A saved layer's state lies at
its cursor in that order: ``x_rows | x | h1 | h3``.

advances every rank's cursor (by ``full_r`` when saving, else by ``input_bytes``) and writes
this rank's element offsets and the three device values its backward needs. As plain torch
ops this was about twenty launches of one-element kernels per layer and three more in its
backward; here it is one (docs/performance.md runs 15c-16: 2.585 -> 2.560 ms of kernels per
training step at T=4096, D=2048, F=768, E=128, K=8 on one H200).

Outputs (all written by the single program):

* ``before`` int64 ``[EP]``: the cursors as they were (the backward restores them);
* ``cursors`` int64 ``[EP]``: advanced in place;
* ``replay`` bool ``[1]``: the layer keeps only its input;
* ``offsets`` int64 ``[4]``: bf16 element offsets from the buffer base of this rank's h1,
  x_rows, h3 (saved; else -1) and of its kept input x (replayed, or saved with
  ``kept_x_bytes``; else -1);
* ``backward`` int64 ``[3]``: the h3 address, where the forward's combine reads the layer's
  route results (``combine_address`` when replayed; else the saved rows' absolute address),
  and what the backward reads h1 and x_rows through: the h1 offset and the x_rows offset
  (the scratch ``h1g`` / ``xs`` offsets when replayed; the scratch ``xs`` offset for x_rows
  when a saved layer keeps no x_rows);
* with ``h3_bytes`` 0 (``MoEConfig.save_route_outputs`` False) a saved layer keeps no route
  results: its h3 offset is -1, its h3 address and deltas are those of a replayed layer;
* ``deltas`` int64 ``[EP]``: for every rank ``r``, where the experts return its route
  results, as a byte shift from its combine buffer: 0 when the layer is replayed, else its
  saved h3 rows' address in its activation buffer (``act_bases[r]`` plus its h3 offset;
  every rank computes every rank's cursors, so all ranks agree) minus ``combine_bases[r]``.
  The experts add it to their return addresses, so a saved layer's h3 rows land in the slot
  at once and are never copied there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels._common import device_context, next_power_of_2
from distmoe.kernels.interpreter import interpreter_active

__all__ = ["begin_layer_on_device"]


@triton.jit
def _align128(n):
    return (n + 127) // 128 * 128


@triton.jit
def _begin_layer_kernel(
    rows_ptr,  # int64 [EP]: executed rows of every rank
    cursors_ptr,  # int64 [EP]: this slot's cursors (bytes from the slot start), in place
    before_ptr,  # int64 [EP] out
    replay_ptr,  # bool [1] out
    offsets_ptr,  # int64 [4] out
    backward_ptr,  # int64 [3] out
    act_bases_ptr,  # int64 [EP]: every rank's activation buffer address
    combine_bases_ptr,  # int64 [EP]: every rank's combine buffer address
    deltas_ptr,  # int64 [EP] out
    rank,
    slot_base,  # bytes from the buffer base to the slot
    slot_bytes,
    input_bytes,
    reserve,  # (layers after this one in the slot) * input_bytes
    kept_x_bytes,  # a saved layer's kept input (0: it keeps x_rows instead)
    h3_bytes,
    combine_address,
    elements_address,
    replay_h1_offset,
    replay_x_offset,
    X_ROW_BYTES: tl.constexpr,
    H1_ROW_BYTES: tl.constexpr,
    EP: tl.constexpr,
    EP_POW2: tl.constexpr,
):
    idx = tl.arange(0, EP_POW2)
    valid = idx < EP
    rows = tl.load(rows_ptr + idx, mask=valid, other=0)
    cur = tl.load(cursors_ptr + idx, mask=valid, other=0)
    x_state = _align128(rows * X_ROW_BYTES) + kept_x_bytes
    full = x_state + _align128(rows * H1_ROW_BYTES) + h3_bytes
    need = tl.max(tl.where(valid, cur + full, 0), axis=0) + reserve
    save = need <= slot_bytes
    tl.store(before_ptr + idx, cur, mask=valid)
    tl.store(cursors_ptr + idx, cur + tl.where(save, full, input_bytes), mask=valid)
    # every rank's saved h3 rows: after its x_rows (or x) and h1 at its cursor
    h3_at = (slot_base + cur + x_state + _align128(rows * H1_ROW_BYTES)
             + tl.load(act_bases_ptr + idx, mask=valid, other=0)
             - tl.load(combine_bases_ptr + idx, mask=valid, other=0))
    keep_h3 = save & (h3_bytes > 0)  # h3_bytes 0: the slot keeps no route results
    tl.store(deltas_ptr + idx, tl.where(keep_h3, h3_at, 0), mask=valid)
    mine = idx == rank
    my_cur = tl.sum(tl.where(mine, cur, 0), axis=0)
    my_rows = tl.sum(tl.where(mine, rows, 0), axis=0)
    start = (slot_base + my_cur) // 2
    x_rows_bytes = _align128(my_rows * X_ROW_BYTES)
    h1_off = start + (x_rows_bytes + kept_x_bytes) // 2
    h3_off = h1_off + _align128(my_rows * H1_ROW_BYTES) // 2
    keep_rows = save & (X_ROW_BYTES > 0)
    keep_x = (save == 0) | (kept_x_bytes > 0)
    tl.store(replay_ptr, save == 0)
    tl.store(offsets_ptr + 0, tl.where(save, h1_off, -1))
    tl.store(offsets_ptr + 1, tl.where(keep_rows, start, -1))
    tl.store(offsets_ptr + 2, tl.where(keep_h3, h3_off, -1))
    tl.store(offsets_ptr + 3, tl.where(keep_x, tl.where(save, start + x_rows_bytes // 2,
                                                        start), -1))
    tl.store(backward_ptr + 0, tl.where(keep_h3, elements_address + 2 * h3_off,
                                        combine_address))
    tl.store(backward_ptr + 1, tl.where(save, h1_off, replay_h1_offset))
    tl.store(backward_ptr + 2, tl.where(keep_rows, start, replay_x_offset))


def _begin_layer_torch(rows, cursors, before, replay, offsets, backward, deltas, *, rank,
                       slot_base, slot_bytes, input_bytes, reserve, h3_bytes, x_row_bytes,
                       h1_row_bytes, combine_address, elements_address, replay_offsets,
                       act_bases, combine_bases, kept_x_bytes=0):
    """The same decision as torch ops: CPU tensors outside the Triton interpreter (where no
    kernel can take them), and the reference of the kernel's tests."""
    def align(n):
        return (n + 127) // 128 * 128

    cur = cursors.clone()
    x_state = align(rows * x_row_bytes) + kept_x_bytes
    full = x_state + align(rows * h1_row_bytes) + h3_bytes
    save = (cur + full).max() + reserve <= slot_bytes
    before.copy_(cur)
    cursors.add_(torch.where(save, full, torch.full_like(full, input_bytes)))
    h3_at = slot_base + cur + x_state + align(rows * h1_row_bytes) + act_bases - combine_bases
    keep_h3 = save & (h3_bytes > 0)
    deltas.copy_(torch.where(keep_h3, h3_at, torch.zeros_like(h3_at)))
    start = (slot_base + cur[rank]) // 2
    x_rows = align(rows[rank] * x_row_bytes)
    h1 = start + (x_rows + kept_x_bytes) // 2
    h3 = h1 + align(rows[rank] * h1_row_bytes) // 2
    neg = torch.full_like(start, -1)
    keep_rows = save & (x_row_bytes > 0)
    kept_x = torch.where(save, start + x_rows // 2, start)
    replay.copy_(~save.reshape(1))
    offsets.copy_(torch.stack([
        torch.where(save, h1, neg), torch.where(keep_rows, start, neg),
        torch.where(keep_h3, h3, neg),
        torch.where(~save | (kept_x_bytes > 0), kept_x, neg)]))
    backward.copy_(torch.stack([
        torch.where(keep_h3, elements_address + 2 * h3, torch.full_like(h3, combine_address)),
        torch.where(save, h1, torch.full_like(h1, replay_offsets[0])),
        torch.where(keep_rows, start, torch.full_like(start, replay_offsets[1])),
    ]))


def begin_layer_on_device(
    rows: torch.Tensor,
    cursors: torch.Tensor,
    *,
    rank: int,
    slot_base: int,
    slot_bytes: int,
    input_bytes: int,
    reserve: int,
    h3_bytes: int,
    x_row_bytes: int,
    h1_row_bytes: int,
    combine_address: int,
    elements_address: int,
    replay_offsets: tuple[int, int],
    act_bases: torch.Tensor | None = None,
    combine_bases: torch.Tensor | None = None,
    kept_x_bytes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the decision (module docstring); ``rows`` and ``cursors`` are int64 ``[EP]`` on
    one device (validated by the caller, :class:`~distmoe.ops.activations.ActivationBuffer`),
    like ``act_bases`` / ``combine_bases`` (every rank's activation and combine buffer
    addresses; ``None``: this rank's ``elements_address`` / ``combine_address`` for every
    rank, meaningful at EP = 1 only). ``kept_x_bytes``: what a saved layer keeps of its input
    instead of gathered rows (with ``x_row_bytes=0``; module docstring). Returns ``(before,
    replay, offsets, backward, deltas)``;
    ``cursors`` is advanced in place. Nothing is read back on the host. CPU tensors outside
    the interpreter take the torch-op path."""
    ep = cursors.shape[0]
    dev = cursors.device
    if act_bases is None:
        act_bases = torch.full((ep,), elements_address, dtype=torch.int64, device=dev)
    if combine_bases is None:
        combine_bases = torch.full((ep,), combine_address, dtype=torch.int64, device=dev)
    before = torch.empty(ep, dtype=torch.int64, device=dev)
    replay = torch.empty(1, dtype=torch.bool, device=dev)
    offsets = torch.empty(4, dtype=torch.int64, device=dev)
    backward = torch.empty(3, dtype=torch.int64, device=dev)
    deltas = torch.empty(ep, dtype=torch.int64, device=dev)
    if dev.type == "cpu" and not interpreter_active():
        _begin_layer_torch(
            rows, cursors, before, replay, offsets, backward, deltas, rank=rank,
            slot_base=slot_base, slot_bytes=slot_bytes, input_bytes=input_bytes,
            reserve=reserve, h3_bytes=h3_bytes, x_row_bytes=x_row_bytes,
            h1_row_bytes=h1_row_bytes, combine_address=combine_address,
            elements_address=elements_address, replay_offsets=replay_offsets,
            act_bases=act_bases, combine_bases=combine_bases, kept_x_bytes=kept_x_bytes)
        return before, replay, offsets, backward, deltas
    with device_context(dev):
        _begin_layer_kernel[(1,)](
            rows, cursors, before, replay, offsets, backward, act_bases, combine_bases, deltas,
            rank, slot_base, slot_bytes, input_bytes, reserve, kept_x_bytes, h3_bytes,
            combine_address,
            elements_address, replay_offsets[0], replay_offsets[1], X_ROW_BYTES=x_row_bytes,
            H1_ROW_BYTES=h1_row_bytes, EP=ep, EP_POW2=max(2, next_power_of_2(ep)), num_warps=1,
        )  # fmt: skip
    return before, replay, offsets, backward, deltas
