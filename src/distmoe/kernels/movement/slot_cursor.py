"""The activation slot's save/replay decision for one layer, in one device program.

:meth:`distmoe.ops.activations.ActivationBuffer.begin_layer` evaluates, for layer ``l`` of the
``L`` layers of a slot and on the device, the planner's rule over every rank's executed rows
``R_r`` (:func:`distmoe.memory.plan_saves`; ``m = L - 1 - l`` layers come after it, ``i`` is
the input's bytes, ``rest_r = align128(R_r*2F*2) + h3_bytes``)::

    rows_r = align128(R_r*X_ROW_BYTES) + rest_r       (the state with the gathered rows)
    xst_r  = kept_x_bytes + rest_r                    (the state with the input x instead)
    need(s) = max_r(cursor_r + s_r) + m*i

``MoEConfig.save_gathered_rows`` True (MODE 0, docs/memory.md section 4): save ``rows`` iff
``need(rows) <= slot_bytes``, else replay. False (MODE 1): the same with ``xst``: a saved
layer keeps its input x and its backward gathers the rows again. ``"auto"`` (MODE 2), a
greedy estimate that takes the later layers' rows to be this layer's: with ``n = m + 1``,
``s_r = max(i, min(rows_r, xst_r))`` (the smaller state) and ``k`` the most of these ``n``
layers that could keep a state beside the others' inputs on every rank (``k = min_r
min(n, (slot_bytes - cursor_r - n*i) // (s_r - i))``), keep the rows iff ``k >= 1`` and
``max_r(cursor_r + rows_r + (k-1)*s_r + (n-k)*i) <= slot_bytes`` (one of the k can be the
rows), else x iff ``need(xst) <= slot_bytes`` and ``need(xst) < need(rows)``, else the rows
iff ``need(rows) <= slot_bytes``, else replay. So replays come first off the budget and
regathers second: a slot with room for every layer's rows keeps them all, one a little
short keeps x in only as many layers as it must. Every saved state leaves room for the
later layers' inputs, so no mode overflows the slot. A saved layer's state lies at its
cursor in the order ``x_rows | h1 | h3`` or ``x | h1 | h3``.

The program advances every rank's cursor (by the kept state, else by ``input_bytes``) and
writes this rank's element offsets and the device values its backward needs, in one launch
where plain torch ops would take about twenty one-element kernels per layer (and three more
in its backward).

The slot and its layer-depth bound ``L`` are read from a device selection (int64 ``[2]``,
written by :meth:`~distmoe.ops.activations.ActivationBuffer.select_slot`) and the layer index
``l`` from the slot's device depth counter, so a graph captured once follows the selections
made before each replay. An invalid selection (slot out of range, bound outside ``[1,
cfg.max_layers_per_slot]``, slot already holding ``L`` layers) keeps nothing, moves nothing
and is counted in a device error record (:data:`ERROR_CODES`) that the host reports.
:func:`end_layer_on_device` is the backward's half: the layer must be its slot's top one
(else an error is counted), and the slot's cursors and depth go back to where its forward
found them.

Outputs (all written by the single program):

* ``where`` int64 ``[3]``: the slot, the layer index and whether the selection was valid
  (the backward's snapshot: later selections cannot redirect it);
* ``before`` int64 ``[EP]``: the cursors as they were (the backward restores them);
* ``cursors`` int64 ``[EP]``: advanced in place;
* ``replay`` bool ``[1]``: the layer keeps only its input;
* ``flags`` int32 ``[3]``: replayed; saved with x kept instead of x_rows (its backward
  gathers the rows again); either of the two (its backward needs x's gather table). The
  backward's device predicates, so it needs no conversion kernels;
* ``offsets`` int64 ``[4]``: bf16 element offsets from the buffer base of this rank's h1,
  x_rows, h3 (saved; else -1) and of its kept input x (replayed, or saved with x kept;
  else -1);
* ``backward`` int64 ``[5]``: the h3 address, where the forward's combine reads the layer's
  route results (``combine_address`` when replayed; else the saved rows' absolute address),
  and what the backward reads h1 and x_rows through: the h1 offset and the x_rows offset
  (the scratch ``h1g`` / ``xs`` offsets when replayed; the scratch ``xs`` offset for x_rows
  when a saved layer keeps no x_rows); then ``[start, in_order]``, the ``x_offset`` of a
  W13 WGRAD that reads the rows in place (``w13_wgrad(x_rows=...)``): the element offset of
  the layer's state (its x_rows or its x) and ``rows_origin`` where it kept its rows (read
  in order, the table unread), else 0 (x's rows through the table);
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

from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context
from distmoe.kernels.base.interpreter import interpreter_active

__all__ = ["ERROR_CODES", "begin_layer_on_device", "end_layer_on_device"]


@triton.jit
def _align128(n):
    return (n + 127) // 128 * 128


@triton.jit
def _count_error(errors_ptr, code, slot, layer):
    """Count a selection error (``code`` != 0) and keep the first one's code, slot, layer."""
    bad = code != 0
    count = tl.load(errors_ptr)
    first = tl.load(errors_ptr + 1)
    keep = bad & (first == 0)
    tl.store(errors_ptr, count + bad.to(tl.int64))
    tl.store(errors_ptr + 1, tl.where(keep, code, first).to(tl.int64))
    tl.store(errors_ptr + 2, tl.where(keep, slot, tl.load(errors_ptr + 2)))
    tl.store(errors_ptr + 3, tl.where(keep, layer, tl.load(errors_ptr + 3)))


@triton.jit
def _end_layer_kernel(where_ptr, before_ptr, cursors_ptr, depth_ptr, errors_ptr,
                      EP: tl.constexpr, EP_POW2: tl.constexpr):
    """A layer's backward leaves its slot: it must be the slot's top layer (else an error is
    counted and nothing moves); the slot's cursors go back to where its forward found them."""
    slot = tl.load(where_ptr)
    layer = tl.load(where_ptr + 1)
    valid = tl.load(where_ptr + 2) != 0
    top = tl.load(depth_ptr + tl.where(valid, slot, 0))
    ok = valid & (top == layer + 1)
    _count_error(errors_ptr, tl.where(valid & (ok == 0), 4, 0), slot, layer)
    idx = tl.arange(0, EP_POW2)
    mask = (idx < EP) & ok
    tl.store(cursors_ptr + slot * EP + idx, tl.load(before_ptr + idx, mask=mask), mask=mask)
    if ok:
        tl.store(depth_ptr + slot, layer)


@triton.jit
def _begin_layer_kernel(
    rows_ptr,  # int64 [EP]: executed rows of every rank
    cursors_ptr,  # int64 [S, EP]: every slot's cursors (bytes from the slot start), in place
    selection_ptr,  # int64 [2]: the selected slot and its layer-depth bound
    depth_ptr,  # int64 [S]: layers each slot holds, in place
    errors_ptr,  # int64 [4]: selection errors (count, first code, its slot, its layer)
    where_ptr,  # int64 [3] out: slot, layer, valid (the backward's snapshot)
    before_ptr,  # int64 [EP] out
    replay_ptr,  # bool [1] out
    offsets_ptr,  # int64 [4] out
    backward_ptr,  # int64 [5] out
    act_bases_ptr,  # int64 [EP]: every rank's activation buffer address
    combine_bases_ptr,  # int64 [EP]: every rank's combine buffer address
    deltas_ptr,  # int64 [EP] out
    flags_ptr,  # int32 [3] out: replay, regather, either
    rank,
    num_slots,
    max_layers,  # cfg.max_layers_per_slot: the largest depth bound a selection may give
    slot_bytes,
    input_bytes,
    kept_x_bytes,  # a saved layer's kept input, where it keeps x instead of x_rows
    h3_bytes,
    combine_address,
    elements_address,
    replay_h1_offset,
    replay_x_offset,
    rows_origin,  # the in-place W13 WGRAD's table origin (0: not read in place)
    X_ROW_BYTES: tl.constexpr,
    H1_ROW_BYTES: tl.constexpr,
    MODE: tl.constexpr,  # 0: x_rows kept, 1: x kept, 2: either (module docstring)
    EP: tl.constexpr,
    EP_POW2: tl.constexpr,
):
    idx = tl.arange(0, EP_POW2)
    valid = idx < EP
    # the selection, checked: an invalid one keeps nothing and counts an error
    sel_slot = tl.load(selection_ptr)
    bound = tl.load(selection_ptr + 1)
    slot_ok = (sel_slot >= 0) & (sel_slot < num_slots)
    slot = tl.where(slot_ok, sel_slot, 0)
    layer = tl.load(depth_ptr + slot)
    bound_ok = (bound >= 1) & (bound <= max_layers)
    code = tl.where(slot_ok == 0, 1, tl.where(bound_ok == 0, 2, tl.where(layer >= bound, 3, 0)))
    ok = code == 0
    _count_error(errors_ptr, code, sel_slot, layer)
    tl.store(where_ptr + 0, sel_slot)
    tl.store(where_ptr + 1, layer)
    tl.store(where_ptr + 2, ok.to(tl.int64))
    tl.store(depth_ptr + slot, layer + ok.to(tl.int64))
    slot_base = slot * slot_bytes
    later = bound - 1 - layer
    cursors_ptr += slot * EP
    rows = tl.load(rows_ptr + idx, mask=valid, other=0)
    cur = tl.load(cursors_ptr + idx, mask=valid, other=0)
    rows_bytes = _align128(rows * X_ROW_BYTES)
    rest = _align128(rows * H1_ROW_BYTES) + h3_bytes
    full_rows = rows_bytes + rest
    full_x = kept_x_bytes + rest
    reserve = later * input_bytes
    need_rows = tl.max(tl.where(valid, cur + full_rows, 0), axis=0) + reserve
    need_x = tl.max(tl.where(valid, cur + full_x, 0), axis=0) + reserve
    if MODE == 0:
        keep_rows = need_rows <= slot_bytes
        keep_x = need_rows < 0  # False
    elif MODE == 1:
        keep_x = need_x <= slot_bytes
        keep_rows = need_x < 0  # False
    else:
        # how many of this and the later layers could keep a state if their rows were this
        # layer's (k); the rows if one of those k states can be the rows (module docstring)
        n = later + 1
        small = tl.maximum(tl.minimum(full_rows, full_x), input_bytes)
        free = slot_bytes - cur - n * input_bytes
        step = small - input_bytes
        fits = tl.minimum(n, free // tl.maximum(step, 1))
        k_r = tl.where(free < 0, 0, tl.where(step > 0, fits, n))
        k = tl.min(tl.where(valid, k_r, n), axis=0)
        over = cur + full_rows + (k - 1) * small + (n - k) * input_bytes - slot_bytes
        rows_ahead = (k >= 1) & (tl.max(tl.where(valid, over, -1), axis=0) <= 0)
        keep_x = (need_x <= slot_bytes) & (need_x < need_rows) & (rows_ahead == 0)
        keep_rows = (need_rows <= slot_bytes) & (keep_x == 0)
    keep_rows = keep_rows & ok
    keep_x = keep_x & ok
    save = keep_rows | keep_x
    x_state = tl.where(keep_rows, rows_bytes, kept_x_bytes)
    full = x_state + rest
    tl.store(before_ptr + idx, cur, mask=valid)
    advance = tl.where(save, full, tl.where(ok, input_bytes, 0))  # invalid: nothing kept
    tl.store(cursors_ptr + idx, cur + advance, mask=valid)
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
    my_x_state = tl.where(keep_rows, _align128(my_rows * X_ROW_BYTES), kept_x_bytes)
    h1_off = start + my_x_state // 2
    h3_off = h1_off + _align128(my_rows * H1_ROW_BYTES) // 2
    tl.store(replay_ptr, save == 0)
    tl.store(flags_ptr + 0, (save == 0).to(tl.int32))
    tl.store(flags_ptr + 1, keep_x.to(tl.int32))
    tl.store(flags_ptr + 2, (keep_rows == 0).to(tl.int32))
    tl.store(offsets_ptr + 0, tl.where(save, h1_off, -1))
    tl.store(offsets_ptr + 1, tl.where(keep_rows, start, -1))
    tl.store(offsets_ptr + 2, tl.where(keep_h3, h3_off, -1))
    tl.store(offsets_ptr + 3, tl.where(keep_rows | (ok == 0), -1, start))
    tl.store(backward_ptr + 0, tl.where(keep_h3, elements_address + 2 * h3_off,
                                        combine_address))
    tl.store(backward_ptr + 1, tl.where(save, h1_off, replay_h1_offset))
    tl.store(backward_ptr + 2, tl.where(keep_rows, start, replay_x_offset))
    tl.store(backward_ptr + 3, tl.where(ok, start, 0))
    tl.store(backward_ptr + 4, tl.where(keep_rows, rows_origin, rows_origin * 0))


#: ``MoEConfig.save_gathered_rows`` -> the kernel's MODE
MODES = {True: 0, False: 1, "auto": 2}


ERROR_CODES = {
    1: "the selected slot lies outside [0, num_slots)",
    2: "the selection's layer-depth bound lies outside [1, cfg.max_layers_per_slot]",
    3: "the selected slot already holds its layer-depth bound of layers",
    4: "a backward ran out of order (its layer was not its slot's top layer)",
}


def _torch_count_error(errors, code, slot, layer):
    if code:
        if not int(errors[1]):
            errors[1:].copy_(torch.tensor([code, slot, layer]))
        errors[0] += 1


def _begin_layer_torch(rows, cursors_all, selection, depth, errors, where, before, replay,
                       offsets, backward, deltas, flags, *, rank, num_slots, max_layers,
                       slot_bytes, input_bytes, mode, h3_bytes, x_row_bytes, h1_row_bytes,
                       kept_x_bytes, combine_address, elements_address, replay_offsets,
                       act_bases, combine_bases, rows_origin=0):
    """The same decision as torch ops: CPU tensors (where the program would run only in
    Triton's interpreter), and the reference of the kernel's tests."""
    def align(n):
        return (n + 127) // 128 * 128

    sel, bound = (int(v) for v in selection.tolist())
    slot_ok = 0 <= sel < num_slots
    slot = sel if slot_ok else 0
    layer = int(depth[slot])
    code = 1 if not slot_ok else 2 if not 1 <= bound <= max_layers else 3 if layer >= bound \
        else 0
    ok = code == 0
    _torch_count_error(errors, code, sel, layer)
    where.copy_(torch.tensor([sel, layer, int(ok)]))
    depth[slot] += int(ok)
    slot_base, later = slot * slot_bytes, bound - 1 - layer
    cursors = cursors_all[slot]
    cur = cursors.clone()
    rows_bytes = align(rows * x_row_bytes)
    rest = align(rows * h1_row_bytes) + h3_bytes
    full_rows, full_x = rows_bytes + rest, kept_x_bytes + rest
    reserve = later * input_bytes
    need_rows = int((cur + full_rows).max()) + reserve
    need_x = int((cur + full_x).max()) + reserve
    if MODES[mode] == 0:
        keep_rows, keep_x = need_rows <= slot_bytes, False
    elif MODES[mode] == 1:
        keep_rows, keep_x = False, need_x <= slot_bytes
    else:
        n = later + 1
        small = torch.minimum(full_rows, full_x).clamp(min=input_bytes)
        free = slot_bytes - cur - n * input_bytes
        step = small - input_bytes
        k = min(0 if f < 0 else min(n, f // st) if st > 0 else n
                for f, st in zip(free.tolist(), step.tolist(), strict=True))
        over = cur + full_rows + (k - 1) * small + (n - k) * input_bytes - slot_bytes
        rows_ahead = k >= 1 and int(over.max()) <= 0
        keep_x = need_x <= slot_bytes and need_x < need_rows and not rows_ahead
        keep_rows = need_rows <= slot_bytes and not keep_x
    keep_rows, keep_x = keep_rows and ok, keep_x and ok
    save = keep_rows or keep_x
    x_state = rows_bytes if keep_rows else torch.full_like(rows, kept_x_bytes)
    full = x_state + rest
    before.copy_(cur)
    cursors.add_(full if save else torch.full_like(full, input_bytes if ok else 0))
    h3_at = slot_base + cur + x_state + align(rows * h1_row_bytes) + act_bases - combine_bases
    keep_h3 = save and h3_bytes > 0
    deltas.copy_(h3_at if keep_h3 else torch.zeros_like(h3_at))
    start = (slot_base + int(cur[rank])) // 2
    h1 = start + int(x_state[rank]) // 2
    h3 = h1 + int(align(rows[rank] * h1_row_bytes)) // 2
    replay.fill_(not save)
    flags.copy_(torch.tensor([not save, keep_x, not keep_rows], dtype=torch.int32))
    offsets.copy_(torch.tensor([h1 if save else -1, start if keep_rows else -1,
                                h3 if keep_h3 else -1, -1 if keep_rows or not ok else start]))
    backward.copy_(torch.tensor([elements_address + 2 * h3 if keep_h3 else combine_address,
                                 h1 if save else replay_offsets[0],
                                 start if keep_rows else replay_offsets[1],
                                 start if ok else 0, rows_origin if keep_rows else 0]))


def _end_layer_torch(where, before, cursors_all, depth, errors):
    slot, layer, valid = (int(v) for v in where.tolist())
    ok = bool(valid) and int(depth[slot]) == layer + 1
    _torch_count_error(errors, 4 if valid and not ok else 0, slot, layer)
    if ok:
        cursors_all[slot].copy_(before)
        depth[slot] = layer


def _torch_path(dev: torch.device, kernel: bool | None) -> bool:
    """Torch ops instead of the kernel: on a CPU device unless ``kernel`` asks for the kernel
    (which runs there only in Triton's interpreter, at a few milliseconds a launch for one
    tiny program; the tests compare the two forms)."""
    if kernel is None:
        return dev.type == "cpu"
    if kernel and dev.type == "cpu" and not interpreter_active():
        raise ValueError("kernel=True on a CPU device needs Triton's interpreter")
    return not kernel


def begin_layer_on_device(
    rows: torch.Tensor,
    cursors: torch.Tensor,
    selection: torch.Tensor,
    depth: torch.Tensor,
    errors: torch.Tensor,
    *,
    rank: int,
    max_layers: int,
    slot_bytes: int,
    input_bytes: int,
    mode: bool | str,
    h3_bytes: int,
    x_row_bytes: int,
    h1_row_bytes: int,
    kept_x_bytes: int,
    combine_address: int,
    elements_address: int,
    replay_offsets: tuple[int, int],
    act_bases: torch.Tensor | None = None,
    combine_bases: torch.Tensor | None = None,
    rows_origin: int = 0,
    kernel: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """Launch the decision (module docstring) for the next layer of the selected slot.

    ``rows``: int64 ``[EP]`` executed rows of every rank; ``cursors``: int64 ``[S, EP]``
    every slot's cursors; ``selection``: int64 ``[2]``, the selected slot and its layer-depth
    bound (at most ``max_layers``, ``cfg.max_layers_per_slot``), read on the device, so a
    captured graph follows later selections; ``depth``: int64 ``[S]`` layers each slot holds;
    ``errors``: int64 ``[4]`` (count, first code of :data:`ERROR_CODES`, its slot, its layer).
    An invalid selection (slot out of range, bound out of range, slot full) keeps nothing:
    the layer is marked replayed with no kept input (its backward's gradients are not valid),
    nothing in any slot moves and the error is counted for the host to report. All on one
    device, like ``act_bases`` / ``combine_bases`` (every rank's activation and combine
    buffer addresses; ``None``: this rank's ``elements_address`` / ``combine_address`` for
    every rank, meaningful at EP = 1 only). ``mode``: ``cfg.save_gathered_rows`` (True,
    False or ``"auto"``); ``x_row_bytes`` / ``kept_x_bytes``: a saved layer's gathered rows
    per row and its kept input x (module docstring); ``rows_origin``: the table origin of a
    W13 WGRAD that reads the layer's rows in place (``backward[4]``; 0 otherwise).

    Returns ``(before, replay, offsets, backward, deltas, flags, where)``; ``where`` int64
    ``[3]`` is the backward's snapshot (slot, layer, valid). ``cursors``, ``depth`` and
    ``errors`` change in place. Nothing is read back on the host. ``kernel``: None runs the
    Triton program on a GPU and the same decision as torch ops on a CPU; True / False force
    one form (tests)."""
    num_slots, ep = cursors.shape
    dev = cursors.device
    if act_bases is None:
        act_bases = torch.full((ep,), elements_address, dtype=torch.int64, device=dev)
    if combine_bases is None:
        combine_bases = torch.full((ep,), combine_address, dtype=torch.int64, device=dev)
    before = torch.empty(ep, dtype=torch.int64, device=dev)
    replay = torch.empty(1, dtype=torch.bool, device=dev)
    offsets = torch.empty(4, dtype=torch.int64, device=dev)
    backward = torch.empty(5, dtype=torch.int64, device=dev)
    deltas = torch.empty(ep, dtype=torch.int64, device=dev)
    flags = torch.empty(3, dtype=torch.int32, device=dev)
    where = torch.empty(3, dtype=torch.int64, device=dev)
    outs = (before, replay, offsets, backward, deltas, flags)
    if _torch_path(dev, kernel):
        _begin_layer_torch(
            rows, cursors, selection, depth, errors, where, *outs, rank=rank,
            num_slots=num_slots, max_layers=max_layers, slot_bytes=slot_bytes,
            input_bytes=input_bytes, mode=mode, h3_bytes=h3_bytes, x_row_bytes=x_row_bytes,
            h1_row_bytes=h1_row_bytes, kept_x_bytes=kept_x_bytes,
            combine_address=combine_address, elements_address=elements_address,
            replay_offsets=replay_offsets, act_bases=act_bases, combine_bases=combine_bases,
            rows_origin=rows_origin)
        return (*outs, where)
    with device_context(dev):
        _begin_layer_kernel[(1,)](
            rows, cursors, selection, depth, errors, where, before, replay, offsets, backward,
            act_bases, combine_bases, deltas, flags, rank, num_slots, max_layers, slot_bytes,
            input_bytes, kept_x_bytes, h3_bytes, combine_address, elements_address,
            replay_offsets[0], replay_offsets[1], rows_origin,
            X_ROW_BYTES=x_row_bytes, H1_ROW_BYTES=h1_row_bytes, MODE=MODES[mode], EP=ep,
            EP_POW2=max(2, next_power_of_2(ep)), num_warps=1,
        )  # fmt: skip
    return (*outs, where)


def end_layer_on_device(where: torch.Tensor, before: torch.Tensor, cursors: torch.Tensor,
                        depth: torch.Tensor, errors: torch.Tensor, *,
                        kernel: bool | None = None) -> None:
    """A layer's backward leaves its slot (one device program): with ``where`` = (slot,
    layer, valid) from its forward, the slot's top layer must be ``layer`` (else error code
    4 is counted and nothing moves); then ``cursors[slot]`` = ``before`` (int64 ``[EP]``)
    and ``depth[slot]`` = ``layer``. A forward whose selection was invalid moves nothing.
    ``kernel`` as in :func:`begin_layer_on_device`."""
    num_slots, ep = cursors.shape
    if _torch_path(cursors.device, kernel):
        _end_layer_torch(where, before, cursors, depth, errors)
        return
    with device_context(cursors.device):
        _end_layer_kernel[(1,)](where, before, cursors, depth, errors, EP=ep,
                                EP_POW2=max(2, next_power_of_2(ep)), num_warps=1)
