"""The device activation buffer of a training context: slots, scratch, save/replay on device.

One allocation of exactly ``plan.activation_buffer_bytes`` bytes (:func:`distmoe.memory.
plan_memory`), laid out as the plan's regions::

    [ slot 0 | slot 1 | ... | slot S-1 | scratch ]
      each slot_capacity_bytes           scratch_bytes (device tier)

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

from dataclasses import dataclass

import torch

from ..config import MoEConfig
from ..kernels.movement.slot_cursor import begin_layer_on_device
from ..memory import MemoryPlan, align128, plan_memory, rows_in_place


@dataclass
class LayerRecord:
    """What a forward leaves for its backward (per call, on the autograd ctx).

    slot / layer: host ints (the slot id snapshot and the layer index in the slot).
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
    h3_deltas: int64 [EP] device values: per owner rank, the byte shift from its combine
        buffer to where the experts return its h3 routes (0 when replayed; else into its
        slot: :mod:`distmoe.kernels.movement.slot_cursor`).
    """

    slot: int
    layer: int
    cursor_before: torch.Tensor
    replay: torch.Tensor
    offsets: torch.Tensor
    backward: torch.Tensor
    h3_deltas: torch.Tensor | None = None
    flags: torch.Tensor | None = None
    state: str = "live"  # "live" -> "done" (its backward ran) or "reset" (reset_slots)


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

        # Device state: per-slot cursors of every rank (bytes from the slot start).
        self.cursors = torch.zeros(self.num_slots, ep_size, dtype=torch.int64, device=device)
        # Host state: the records of the layers each slot holds (bottom first), and the
        # selected slot.
        self.stacks: list[list[LayerRecord]] = [[] for _ in range(self.num_slots)]
        self.slot = 0

    # ----------------------------------------------------------------- slot selection
    def select_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int, got {type(slot).__name__} ({slot!r})")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot ({slot}) must lie in [0, num_slots={self.num_slots})")
        self.slot = slot

    @property
    def depth(self) -> list[int]:
        """Layers each slot holds."""
        return [len(stack) for stack in self.stacks]

    def reset_slots(self) -> None:
        """Forget every slot's layers. Call it on every rank at the same point (the state is
        replicated, never exchanged): after an aborted schedule, or after forwards whose
        outputs were dropped without a backward (their layers stay in the slot otherwise; they
        are not released when their graphs are freed, because garbage collection runs at a
        different moment on each rank and the ranks' decisions would drift apart). A later
        backward of a forgotten layer raises."""
        for stack in self.stacks:
            for rec in stack:
                rec.state = "reset"
        self.stacks = [[] for _ in range(self.num_slots)]
        self.cursors.zero_()

    def check_room(self) -> None:
        """Before a forward touches anything: the selected slot must have a free layer."""
        s = self.slot
        held = len(self.stacks[s])
        if held >= self.layers_per_slot:
            raise ValueError(
                f"slot {s} already holds {held} layers, its limit "
                f"(max_layers_per_slot={self.layers_per_slot}); run their backwards, "
                f"select another slot (select_slot) or raise max_layers_per_slot. A training "
                f"forward whose output was dropped without a backward keeps its layer until "
                f"ctx.reset_slots() (called on every rank)"
            )

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
        layer = len(self.stacks[s])
        D, F = self.cfg.hidden, self.cfg.ffn
        so = self.scratch_elem_offsets
        before, replay, offsets, backward, deltas, flags = begin_layer_on_device(
            executed_rows_EP.to(device=self.device, dtype=torch.int64).contiguous(),
            self.cursors[s], rank=self.rank, slot_base=s * self.slot_bytes,
            slot_bytes=self.slot_bytes, input_bytes=self.input_bytes,
            later=self.layers_per_slot - 1 - layer, mode=self.cfg.save_gathered_rows,
            h3_bytes=self.h3_bytes, x_row_bytes=D * 2, h1_row_bytes=2 * F * 2,
            kept_x_bytes=self.input_bytes,
            combine_address=combine_address, elements_address=self.elements.data_ptr(),
            replay_offsets=(so["h1g"], so.get("xs", -1)), act_bases=act_bases,
            combine_bases=combine_bases, rows_origin=rows_origin,
        )  # fmt: skip
        rec = LayerRecord(slot=s, layer=layer, cursor_before=before, replay=replay,
                          offsets=offsets, backward=backward, h3_deltas=deltas, flags=flags)
        self.stacks[s].append(rec)
        return rec

    def abandon_layer(self, rec: LayerRecord) -> None:
        """Undo :meth:`begin_layer` of a forward that failed before autograd recorded it."""
        stack = self.stacks[rec.slot]
        if stack and stack[-1] is rec:
            stack.pop()
            self.cursors[rec.slot].copy_(rec.cursor_before)
        rec.state = "reset"

    # ----------------------------------------------------------------- backward
    def end_layer(self, rec: LayerRecord, *, restore: bool = True) -> None:
        """Backward of ``rec``'s layer: it must be the slot's last live layer; rewind the
        cursor (with ``restore=False`` the caller does, :meth:`restore_cursor`, so that the
        device part can sit in a CUDA graph)."""
        stack = self.stacks[rec.slot]
        if rec.state != "live" or not stack or stack[-1] is not rec:
            if rec.state == "done":
                why = ("its backward already ran (a second backward through a MoE layer needs "
                       "its state, which the first one released)")
            elif rec.state == "reset":
                why = "the slots were reset after its forward"
            else:
                why = (f"the slot holds {len(stack)} layers: the layers of a slot must run "
                       "their backwards in reverse order of their forwards")
            raise RuntimeError(f"backward of layer {rec.layer} of slot {rec.slot}: {why}")
        stack.pop()
        rec.state = "done"
        if restore:
            self.restore_cursor(rec)

    def restore_cursor(self, rec: LayerRecord) -> None:
        """The device part of :meth:`end_layer`: the slot's cursors back to where ``rec``'s
        forward started (one device copy)."""
        self.cursors[rec.slot].copy_(rec.cursor_before)

    def stats(self) -> dict:
        """Host view (synchronises): allocation, per-slot depth and cursors (bytes)."""
        return dict(activation_buffer_bytes=self.storage.numel(),
                    slot_capacity_bytes=self.slot_bytes, num_slots=self.num_slots,
                    scratch_bytes=self.plan.scratch_bytes, slot_depth=list(self.depth),
                    slot_cursors=self.cursors.tolist(), always_saves=self.always_saves,
                    regathers=self.regathers, may_regather=self.may_regather,
                    rows_in_place=self.rows_in_place)
