"""The device activation buffer of a training context: slots, scratch, save/replay on device.

One allocation of exactly ``plan.activation_buffer_bytes`` bytes (:func:`distmoe.memory.
plan_memory`), laid out as the plan's regions::

    [ slot 0 | slot 1 | ... | slot S-1 | scratch ]
      each slot_capacity_bytes           scratch_bytes (device tier)

(An FP8 training context has the scratch only: its layers keep their state in per-call
tensors, :func:`~distmoe.memory.keeps_state_in_slots`.)

**Slots** keep what backward needs until the backward runs. The layers of one slot pack one
after the other from the slot's cursor. For layer ``l`` of ``L = cfg.max_layers_per_slot`` in
a slot, every rank evaluates on its device, with every rank's executed rows ``R_r`` (the
routing tables give them to every rank without communication), the planner's rule::

    full_r = align128(R_r*D*2) + align128(R_r*2F*2) + align128(T_max*K*D*2)
    save   = max_r(saved_r + full_r) + (L - 1 - l) * align128(T_max*D*2) <= slot_capacity

so all ranks take the same decision, inside CUDA-graph replay too. A saved layer keeps its
gathered rows, h1 and its returned route results (``x_rows [R, D] | h1 [R, 2F] | h3 [T_max*K,
D]`` at the cursor); a replayed layer keeps its input ``x [T, D]`` only and rebuilds the rest
in backward. With ``cfg.save_gathered_rows`` False a saved layer keeps ``x [T, D] | h1 | h3``
(``align128(R_r*D*2)`` becomes ``align128(T_max*D*2)`` in ``full_r``) and its backward
gathers the rows again into scratch ``xs``; with ``"auto"`` each layer chooses one of the
three on the device (:mod:`distmoe.kernels.movement.slot_cursor` states the rule). Every rank
advances every rank's cursor (``saved_r``) the same way, so the cursors stay identical
replicas. Backward runs in reverse layer order and restores the cursor that its forward
started from; it uses the slot id its forward recorded, whatever slot is selected later.

**Scratch** is shared by all calls, one at a time (activation rows, ``R = R_b`` the device
receive bound)::

    xs   [R, D]   replayed (or regathered) rows     (backward of a layer without x_rows;
                  absent where the rows are read in place, memory.rows_in_place)
    h1g  [R, 2F]  replayed h1, then grad_h1 in place (backward)
    h2   [R, F]   SwiGLU output (forward), score * h2 (backward, for W2 WGRAD)
    gh3  [R, D]   the routes' grad_y rows (unscaled), in activation rows: written by their
                  owners (peer writes when the buffer is a heap allocation), read by W2
                  DGRAD/WGRAD

``2R(2D + 3F)`` bytes before alignment, never more than the planner's peak ``scratch_bytes``
(checked at construction; the planner's layout keeps grad_h2 separately, ours writes grad_h1
over h1 instead).
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import torch

from ..config import MoEConfig
from ..kernels.movement.slot_cursor import (
    ERROR_CODES,
    begin_layer_on_device,
    end_layer_on_device,
)
from ..memory import MemoryPlan, align128, keeps_state_in_slots, plan_memory, rows_in_place


@dataclass(eq=False)  # identity: the host's live list removes records by identity
class LayerRecord:
    """What a forward leaves for its backward (per call, on the autograd ctx).

    slot / layer: host ints (the slot id and the layer index in the slot), None where the
        slot was selected with device tensors (the device knows them: ``where``).
    cursor_before: int64 [EP] device copy of the slot cursors when the forward started.
    replay: bool [1] device flag, True when the layer keeps only its input.
    flags: int32 [3] device predicates for the backward's kernels: replayed; saved with x
        kept instead of x_rows (its backward gathers the rows again); either of the two.
    offsets: int64 [4] device element offsets (bf16 elements from the buffer base) of this
        rank's saved h1, x_rows, h3 routes (or -1 when replayed) and of the kept input x
        (-1 when saved). The order matches the W13 kernel's ``out_offsets = [h1, x]``.
    backward: int64 [5] device values: the h3 routes' absolute address (the combine
        buffer's when replayed), where the forward's combine reads them, and the element
        offsets of h1 and x_rows (the scratch ``h1g`` / ``xs`` when replayed), which the
        backward reads its state through (it reads no h3: the experts compute the score
        gradients, :mod:`distmoe.ops.autograd`); then the in-place W13 WGRAD's
        ``x_offset`` (:mod:`distmoe.kernels.movement.slot_cursor`).
    where: int64 [3] device snapshot of the slot, the layer index and whether the selection
        was valid: the backward rewinds this slot, whatever is selected later.
    h3_deltas: int64 [EP] device values: per owner rank, the byte shift from its combine
        buffer to where the experts return its h3 routes (0 when replayed; else into its
        slot: :mod:`distmoe.kernels.movement.slot_cursor`).
    """

    slot: int | None
    layer: int | None
    cursor_before: torch.Tensor
    replay: torch.Tensor
    offsets: torch.Tensor
    backward: torch.Tensor
    h3_deltas: torch.Tensor | None = None
    flags: torch.Tensor | None = None
    where: torch.Tensor | None = None
    state: str = "live"  # "live" -> "done" (its backward ran) or "reset" (reset_slots)
    owner: object = None  # weakref to what runs its backward (an autograd node), or None

    def describe(self) -> str:
        """``"layer L of slot S"``, with what the host does not know (a slot selected with
        device tensors) said so."""
        layer = self.layer if self.layer is not None else "?"
        slot = self.slot if self.slot is not None else "(selected on the device)"
        return f"layer {layer} of slot {slot}"

    def owned(self) -> bool:
        """A live layer whose backward can still run (its owner is alive)."""
        return self.state == "live" and self.owner is not None and self.owner() is not None


class ActivationBuffer:
    """Slots + scratch of one training context on one rank (see the module docstring).

    Args:
        cfg: the layer configuration (``cfg.training`` must be True).
        ep_size / rank: the EP group size and this rank.
        device: where to allocate.
        allocate: optional ``allocate(num_bytes) -> uint8 tensor`` of at least ``num_bytes``
            on ``device``, e.g. a symmetric-heap allocation, so that peers can write into
            this rank's scratch (the layer's owners push route gradients into ``gh3``);
            ``None`` allocates a plain tensor.
    """

    def __init__(self, cfg: MoEConfig, ep_size: int, rank: int, device: torch.device,
                 allocate=None) -> None:
        if not cfg.training:
            raise ValueError("ActivationBuffer needs cfg.training=True")
        if cfg.total_scratch_factor is not None:
            raise ValueError(
                f"total_scratch_factor ({cfg.total_scratch_factor}): host-backed (VMM) scratch "
                "is not implemented; leave it None"
            )
        plan = plan_memory(cfg, ep_size)
        if not keeps_state_in_slots(cfg):  # an FP8 training context: scratch only
            plan = dataclasses.replace(plan, slot_capacity_bytes=0)
        self.plan: MemoryPlan = plan
        self.cfg = cfg
        self.ep_size, self.rank, self.device = ep_size, rank, device
        T, K, D, F = cfg.max_tokens, cfg.top_k, cfg.hidden, cfg.ffn
        R = plan.device_receive_bound
        self.rows = R
        self.num_slots = plan.num_slots
        self.layers_per_slot = plan.layers_per_slot
        self.slot_bytes = plan.slot_capacity_bytes
        self.input_bytes = plan.input_bytes
        # 0 when the slot does not keep the route results (cfg.save_route_outputs False)
        self.h3_bytes = align128(T * K * D * 2) if cfg.save_route_outputs else 0
        # Static: does every layer save whatever the routing? (then backward never replays)
        # (a layer's test reserves an input per later layer, hence the max; under "auto" the
        # later layers' smaller states, never more than the rows at the bound)
        self.always_saves = self.layers_per_slot * max(plan.full_state_bytes(R),
                                                       self.input_bytes) <= self.slot_bytes
        # Saved layers keep x instead of x_rows: every backward gathers the rows again; with
        # "auto" some may (none where every layer saves its rows whatever the routing).
        self.regathers = cfg.save_gathered_rows is False
        self.may_regather = self.regathers or (cfg.save_gathered_rows == "auto"
                                               and not self.always_saves)
        # ... and the W13 WGRAD reads them in place instead (EP = 1): no scratch xs
        self.rows_in_place = rows_in_place(cfg, ep_size)

        nbytes = plan.activation_buffer_bytes
        if allocate is None:
            self.storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            self.storage = allocate(nbytes)[:nbytes]
        self.elements = self.storage.view(torch.bfloat16)  # base of every offset
        # Scratch views, in activation rows.
        base = plan.slots_bytes
        layout = {}
        names = (("h1g", 2 * F), ("h2", F), ("gh3", D))
        for name, width in names if self.rows_in_place else (("xs", D), *names):
            layout[name] = (base, width)
            base += align128(R * width * 2)
        used = base - plan.slots_bytes
        if used > plan.scratch_bytes:
            raise RuntimeError(  # a planner/buffer mismatch is a bug, not a user error
                f"internal: scratch layout needs {used} B, the plan reserves "
                f"{plan.scratch_bytes} B"
            )
        self.scratch_layout = {n: (off, w) for n, (off, w) in layout.items()}
        self.scratch = {
            name: self.storage[off:off + R * w * 2].view(torch.bfloat16).view(R, w)
            for name, (off, w) in layout.items()
        }
        self.scratch_elem_offsets = {name: off // 2 for name, (off, _) in layout.items()}

        # Device state: per-slot cursors of every rank (bytes from the slot start), the
        # selection (slot, layer-depth bound), layers per slot, and the selection errors
        # (slot_cursor.ERROR_CODES: count, first code, its slot, its layer).
        S, L = self.num_slots, self.layers_per_slot
        self.cursors = torch.zeros(S, ep_size, dtype=torch.int64, device=device)
        self.selection = torch.tensor([0, L], dtype=torch.int64, device=device)
        self.depth_on_device = torch.zeros(S, dtype=torch.int64, device=device)
        self.errors = torch.zeros(4, dtype=torch.int64, device=device)
        # every (slot, bound) selection a host int can make, so select_slot is one copy
        self._choices = torch.tensor([[s, b] for s in range(S) for b in range(1, L + 1)],
                                     dtype=torch.int64, device=device).view(S, L, 2)
        # the error record as the host reads it without synchronising: the tensor itself on
        # the CPU, a pinned copy refreshed after each device-selected layer on a GPU
        pinned = device.type == "cuda"
        self._errors_host = (torch.zeros(4, dtype=torch.int64, pin_memory=True) if pinned
                             else self.errors)
        self._errors_view = self._errors_host.numpy()
        # Host state: the live layers (forward order) and the selection as the host knows it
        # (slot/bound None: selected with device tensors, known on the device only).
        self.records: list[LayerRecord] = []
        self.slot: int | None = 0
        self.bound: int | None = L

    # ----------------------------------------------------------------- slot selection
    def select_slot(self, slot, max_layers=None) -> None:
        """Select the slot that the next forwards append to, and its layer-depth bound (the
        layers its owner will put there, which the save rule reserves inputs for; default
        ``cfg.max_layers_per_slot``). Host ints are checked here; device tensors (one
        integer element each, on this buffer's device) are copied without synchronising and
        checked by the forward's kernel, so a captured graph replays with the values they
        hold at replay time. Either way the device selection is what forwards read."""
        L = self.layers_per_slot
        host = [self._check_choice("slot", slot, 0, self.num_slots - 1,
                                   f"[0, num_slots={self.num_slots})"),
                self._check_choice("max_layers", L if max_layers is None else max_layers, 1,
                                   L, f"[1, cfg.max_layers_per_slot={L}]")]
        if host[0] is not None and host[1] is not None:
            self.selection.copy_(self._choices[host[0], host[1] - 1])
        else:
            for i, value in enumerate((slot, L if max_layers is None else max_layers)):
                if isinstance(value, torch.Tensor):
                    self.selection[i:i + 1].copy_(value.reshape(1))
                else:
                    self.selection[i:i + 1].fill_(value)
        self.slot, self.bound = host

    def _check_choice(self, name: str, value, low: int, high: int, rule: str) -> int | None:
        """A host int in ``[low, high]`` (returned; ``rule`` words the range), or a
        one-element integer tensor on this buffer's device (None: known on the device only)."""
        if isinstance(value, torch.Tensor):
            if value.dtype.is_floating_point or value.dtype.is_complex \
                    or value.dtype == torch.bool or value.numel() != 1:
                raise TypeError(f"{name} as a tensor must hold one integer, got dtype "
                                f"{value.dtype} with {value.numel()} elements")
            if value.device != self.device:
                raise ValueError(f"{name} as a tensor must be on {self.device} (read on the "
                                 f"device without synchronising), got {value.device}")
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int or a one-element device tensor, got "
                            f"{type(value).__name__} ({value!r})")
        if not low <= value <= high:
            raise ValueError(f"{name} ({value}) must lie in {rule}")
        return value

    def host_depth(self, slot: int) -> int | None:
        """Live layers in ``slot`` as the host knows them (None while a device-selected
        layer is live: only the device knows where it went)."""
        if any(rec.slot is None for rec in self.records):
            return None
        return sum(rec.slot == slot for rec in self.records)

    @property
    def depth(self) -> list[int]:
        """Layers each slot holds (device counters: synchronises; for tools and tests)."""
        return self.depth_on_device.tolist()

    def errors_text(self) -> str | None:
        """The first slot selection error the device recorded (read without synchronising:
        it may show a little after the kernel that found it), else None."""
        count, code, slot, layer = (int(v) for v in self._errors_view)
        if not count:
            return None
        return (f"{count} slot selection error(s) on the device; the first: "
                f"{ERROR_CODES.get(code, code)} (slot {slot}, layer {layer}). That layer "
                "kept nothing and its gradients are not valid; call reset_slots() on every "
                "rank and run the schedule again")

    def reset_slots(self) -> None:
        """Forget every slot's layers. Call it on every rank at the same point (the state is
        replicated, never exchanged): after an aborted schedule, or after forwards whose
        outputs were dropped without a backward (their layers stay in the slot otherwise; they
        are not released when their graphs are freed, because garbage collection runs at a
        different moment on each rank and the ranks' decisions would drift apart). Refused
        (RuntimeError, nothing changed) while a layer's backward can still run: its autograd
        graph is alive and owns its state. A later backward of a forgotten layer raises.
        Clears the selection error record."""
        owned = [rec for rec in self.records if rec.owned()]
        if owned:
            gc.collect()  # graphs held only through reference cycles
            owned = [rec for rec in owned if rec.owned()]
        if owned:
            where = ", ".join(rec.describe() for rec in owned[:4])
            raise RuntimeError(
                f"reset_slots: {len(owned)} layer(s) still owned by a backward that can run "
                f"({where}); run their backwards or drop their outputs first")
        for rec in self.records:
            rec.state = "reset"
        self.records = []
        self.cursors.zero_()
        self.depth_on_device.zero_()
        self.errors.zero_()
        if self._errors_host is not self.errors:
            self._errors_host.zero_()

    def check_room(self) -> None:
        """Before a forward touches anything: no earlier selection error, and the selected
        slot (where the host knows it) must have a free layer."""
        text = self.errors_text()
        if text is not None:
            raise RuntimeError(f"MoE layer: {text}")
        s = self.slot
        held = None if s is None else self.host_depth(s)
        if held is not None and self.bound is not None and held >= self.bound:
            limit = ("its limit (max_layers_per_slot=" if self.bound == self.layers_per_slot
                     else "the bound given to select_slot (max_layers=")
            raise ValueError(
                f"slot {s} already holds {held} layers, {limit}{self.bound}); run their "
                f"backwards, select another slot (select_slot) or raise max_layers_per_slot. "
                f"A training forward whose output was dropped without a backward keeps its "
                f"layer until ctx.reset_slots() (called on every rank)"
            )

    def _mirror_errors(self) -> None:
        """Refresh the pinned copy of the error record (GPU; stream-ordered, no sync)."""
        if self._errors_host is not self.errors:
            self._errors_host.copy_(self.errors, non_blocking=True)

    # ----------------------------------------------------------------- forward
    def begin_layer(self, executed_rows_EP: torch.Tensor, combine_address: int, *,
                    act_bases: torch.Tensor | None = None,
                    combine_bases: torch.Tensor | None = None,
                    rows_origin: int = 0) -> LayerRecord:
        """Decide save/replay on the device for the next layer of the selected slot, advance
        the cursors and return the record for backward (no host synchronisation; one device
        program, :mod:`distmoe.kernels.movement.slot_cursor`). ``combine_address``: the absolute
        address of this rank's combine buffer, where a replayed layer's backward finds its h3
        routes. ``act_bases`` / ``combine_bases``: int64 ``[EP]`` device tables of every rank's
        activation buffer and combine buffer addresses (the heap's base tables), for the
        record's ``h3_deltas``; ``None``: this rank's addresses stand for every rank's.
        ``rows_origin``: where the rows are read in place (:attr:`rows_in_place`), the origin
        of the gather table the W13 WGRAD reads them through (``backward[4]``)."""
        if isinstance(combine_address, bool) or not isinstance(combine_address, int) \
                or combine_address <= 0:
            raise ValueError(f"combine_address ({combine_address!r}) must be a positive int "
                             "(the combine buffer's data_ptr())")
        self.check_room()
        s = self.slot
        layer = None if s is None else self.host_depth(s)
        D, F = self.cfg.hidden, self.cfg.ffn
        so = self.scratch_elem_offsets
        before, replay, offsets, backward, deltas, flags, where = begin_layer_on_device(
            executed_rows_EP.to(device=self.device, dtype=torch.int64).contiguous(),
            self.cursors, self.selection, self.depth_on_device, self.errors, rank=self.rank,
            max_layers=self.layers_per_slot, slot_bytes=self.slot_bytes,
            input_bytes=self.input_bytes, mode=self.cfg.save_gathered_rows,
            h3_bytes=self.h3_bytes, x_row_bytes=D * 2, h1_row_bytes=2 * F * 2,
            kept_x_bytes=self.input_bytes,
            combine_address=combine_address, elements_address=self.elements.data_ptr(),
            replay_offsets=(so["h1g"], so.get("xs", -1)), act_bases=act_bases,
            combine_bases=combine_bases, rows_origin=rows_origin,
        )  # fmt: skip
        if s is None:
            self._mirror_errors()
        rec = LayerRecord(slot=s, layer=layer, cursor_before=before, replay=replay,
                          offsets=offsets, backward=backward, h3_deltas=deltas, flags=flags,
                          where=where)
        self.records.append(rec)
        return rec

    def push(self, rec: LayerRecord) -> None:
        """Register a layer whose forward ran from a captured graph (its device part, the
        slot decision included, ran in the replay)."""
        self.records.append(rec)

    def forget(self, rec: LayerRecord) -> None:
        """Drop ``rec`` from the host's live layers without touching the device (a graph
        capture recorded its forward without running it)."""
        self.records.remove(rec)

    def abandon_layer(self, rec: LayerRecord) -> None:
        """Undo :meth:`begin_layer` of a forward that failed before autograd recorded it."""
        if rec.state == "live" and self.records and self.records[-1] is rec:
            self.records.pop()
            self.restore_cursor(rec)
        rec.state = "reset"

    # ----------------------------------------------------------------- backward
    def end_layer(self, rec: LayerRecord, *, restore: bool = True) -> None:
        """Backward of ``rec``'s layer: where the host knows its slot, it must be the slot's
        last live layer (the device checks it in any case); rewind the cursor (with
        ``restore=False`` the caller does, :meth:`restore_cursor`, so that the device part
        can sit in a CUDA graph)."""
        why = None
        if rec.state == "done":
            why = ("its backward already ran (a second backward through a MoE layer needs "
                   "its state, which the first one released)")
        elif rec.state == "reset":
            why = "the slots were reset after its forward"
        elif rec.slot is not None and self.host_depth(rec.slot) is not None:
            stack = [r for r in self.records if r.slot == rec.slot]
            if stack[-1] is not rec:
                why = (f"the slot holds {len(stack)} layers: the layers of a slot must run "
                       "their backwards in reverse order of their forwards")
        if why is not None:
            raise RuntimeError(f"backward of {rec.describe()}: {why}")
        self.records.remove(rec)
        rec.state = "done"
        if restore:
            self.restore_cursor(rec)

    def restore_cursor(self, rec: LayerRecord) -> None:
        """The device part of :meth:`end_layer`: the slot's cursors back to where ``rec``'s
        forward started and its depth one less, if ``rec`` is the slot's top layer (else a
        device error is counted), in one device program."""
        end_layer_on_device(rec.where, rec.cursor_before, self.cursors, self.depth_on_device,
                            self.errors)
        if rec.slot is None:
            self._mirror_errors()

    def stats(self) -> dict:
        """Host view (synchronises): allocation, per-slot depth and cursors (bytes)."""
        return dict(activation_buffer_bytes=self.storage.numel(),
                    slot_capacity_bytes=self.slot_bytes, num_slots=self.num_slots,
                    scratch_bytes=self.plan.scratch_bytes, slot_depth=list(self.depth),
                    slot_cursors=self.cursors.tolist(), selection=self.selection.tolist(),
                    slot_errors=self.errors.tolist(), always_saves=self.always_saves,
                    regathers=self.regathers, may_regather=self.may_regather,
                    rows_in_place=self.rows_in_place)
