"""The activation buffer: planner-sized allocation, device-side save/replay, slots, replay in
backward (bit-identical gradients), torch.utils.checkpoint."""

import functools

import pytest
import torch
import torch.utils.checkpoint as ckpt
from forward_cases import make_problem

import distmoe as dm
from distmoe.memory import kept_x_state_bytes, trace_saves
from distmoe.ops.activations import ActivationBuffer
from distmoe.reference import split_global_problem

# ----------------------------------------------------------------------------- decisions


def _worked_cfg(capacity, save_gathered_rows=True):
    # DESIGN.md's worked example: EP=2, T=2, K=2, D=F=256, four layers in one slot.
    return dm.MoEConfig(hidden=256, ffn=256, num_experts=4, top_k=2, max_tokens=2,
                        row_block=16, device_scratch_factor=2.0, max_layers_per_slot=4,
                        activation_bytes=capacity, save_gathered_rows=save_gathered_rows)


ROWS = [[4, 4], [4, 4], [5, 3], [5, 3]]  # [layer][rank]


@pytest.mark.parametrize("capacity, replays, gathered", [
    (28_672, [False, False, False, True], True),
    (24_576, [False, False, True, True], True),
    # saved layers keep x (1024 B) instead of their rows (2048-2560 B): one more layer saves
    (24_576, [False, False, False, True], False),
    (20_480, [False, False, True, True], False)])
def test_device_decisions_follow_the_planner(capacity, replays, gathered):
    cfg = _worked_cfg(capacity, gathered)
    trace = trace_saves(cfg, capacity, ROWS)
    assert [not d for d in trace.decisions] == replays
    for rank in (0, 1):
        buf = ActivationBuffer(cfg, 2, rank, torch.device("cpu"))
        recs = []
        for layer, rows in enumerate(ROWS):
            combine_address = 4096 * (rank + 3)  # any address: only passed through
            rec = buf.begin_layer(torch.tensor(rows), combine_address)
            recs.append(rec)
            assert bool(rec.replay) == replays[layer]
            assert buf.cursors[0].tolist() == list(trace.saved_bytes[layer])
            start = rec.cursor_before[rank].item() // 2
            mine = rows[rank]
            scratch = buf.scratch_elem_offsets
            if replays[layer]:
                assert rec.offsets.tolist() == [-1, -1, -1, start]
                # the backward rebuilds h3 in the combine buffer, h1 and x_rows in scratch
                assert rec.backward.tolist() == [combine_address, scratch["h1g"], scratch["xs"],
                                                 start, 0]
                assert rec.h3_deltas.tolist() == [0, 0]  # route results stay in combine
            else:
                # x_rows at the cursor, or (gathered False) the input x [T=2, D] there and the
                # rows gathered again into scratch xs by the backward
                x_bytes = (mine if gathered else 2) * 256 * 2
                h1_bytes = mine * 512 * 2  # both multiples of 128
                h1, h3 = start + x_bytes // 2, start + (x_bytes + h1_bytes) // 2
                h3_address = buf.elements.data_ptr() + 2 * h3
                if gathered:
                    assert rec.offsets.tolist() == [h1, start, h3, -1]
                    assert rec.backward.tolist() == [h3_address, h1, start, start, 0]
                else:
                    assert rec.offsets.tolist() == [h1, -1, h3, start]
                    assert rec.backward.tolist() == [h3_address, h1, scratch["xs"], start, 0]
                # the experts return this rank's h3 rows straight into its slot
                assert combine_address + rec.h3_deltas[rank].item() == rec.backward[0].item()
        with pytest.raises(ValueError, match="slot 0 already holds 4 layers"):
            buf.begin_layer(torch.tensor([1, 1]), 4096)
        with pytest.raises(ValueError, match=r"combine_address \(0\) must be a positive int"):
            buf.begin_layer(torch.tensor([1, 1]), 0)
        with pytest.raises(RuntimeError, match="reverse order"):
            buf.end_layer(recs[1])
        for layer in reversed(range(4)):
            buf.end_layer(recs[layer])
            expected = trace.saved_bytes[layer - 1] if layer else (0, 0)
            assert buf.cursors[0].tolist() == list(expected)
        assert buf.depth == [0]


@pytest.mark.parametrize("mode", [True, False, "auto"], ids=["rows", "x", "auto"])
@pytest.mark.parametrize("ep, layers", [(1, 6), (3, 5), (4, 6), (8, 3)])
def test_device_decisions_match_the_planner_on_random_rows(ep, layers, mode):
    """Random received rows per layer and rank, capacities from the inputs-only minimum to
    beyond the useful maximum: every rank's device decisions, what its layers keep and its
    cursors equal trace_saves, for every ``save_gathered_rows`` mode."""
    g = torch.Generator().manual_seed(ep * 100 + layers)
    cfg0 = dm.MoEConfig(hidden=96, ffn=160, num_experts=8 * ep, top_k=4, max_tokens=24,
                        device_scratch_factor=2.5, max_layers_per_slot=layers,
                        save_gathered_rows=mode)
    plan = dm.plan_memory(cfg0, ep)
    bound = plan.device_receive_bound
    seen, kinds = set(), set()
    for trial in range(6):
        cap = int(torch.randint(plan.min_slot_bytes, plan.useful_max_slot_bytes + 4096, (1,),
                                generator=g)) // 128 * 128
        cfg = dm.MoEConfig(**{**vars(cfg0), "activation_bytes": cap})
        # executed rows: the routes of a random skew, some inactive, clamped to the bound
        total = ep * cfg.max_tokens * cfg.top_k
        rows = []
        for _ in range(layers):
            weights = torch.rand(ep, generator=g) ** 4 + 1e-3
            active = int(torch.randint(total // 2, total + 1, (1,), generator=g))
            owners = torch.multinomial(weights, active, replacement=True, generator=g)
            rows.append(torch.bincount(owners, minlength=ep).clamp(max=bound).tolist())
        trace = trace_saves(cfg, cap, rows)
        seen.update(trace.decisions)
        for rank in (0, ep - 1):
            buf = ActivationBuffer(cfg, ep, rank, torch.device("cpu"))
            for layer in range(layers):
                rec = buf.begin_layer(torch.tensor(rows[layer]), 4096)
                assert bool(rec.replay) == (not trace.decisions[layer]), (trial, layer)
                replayed, as_x, rebuild = rec.flags.tolist()
                kept = "input" if replayed else "x" if as_x else "rows"
                assert kept == trace.kept[layer] and rebuild == (kept != "rows")
                kinds.add(kept)
                assert buf.cursors[0].tolist() == list(trace.saved_bytes[layer])
                assert buf.cursors[0].max().item() <= cap  # never past the slot
    assert seen == {True, False}  # both saves and replays were exercised
    if mode == "auto" and ep == 1:  # (at EP > 1 a rank's x can outweigh its rows)
        assert kinds == {"rows", "x", "input"}, kinds


def test_abandon_reset_and_backward_errors():
    cfg = _worked_cfg(28_672)
    buf = ActivationBuffer(cfg, 2, 0, torch.device("cpu"))
    a = buf.begin_layer(torch.tensor(ROWS[0]), 4096)
    b = buf.begin_layer(torch.tensor(ROWS[1]), 4096)
    buf.abandon_layer(b)  # a forward that failed after begin_layer: undone
    assert buf.depth == [1] and buf.cursors.tolist() == [list(trace_saves(
        cfg, 28_672, ROWS[:1]).saved_bytes[0])]
    buf.end_layer(a)
    assert buf.depth == [0] and buf.cursors.tolist() == [[0, 0]]
    with pytest.raises(RuntimeError, match="its backward already ran"):
        buf.end_layer(a)
    d = buf.begin_layer(torch.tensor(ROWS[3]), 4096)  # e.g. an output dropped without backward
    with pytest.raises(ValueError, match=r"ctx.reset_slots\(\)"):
        for _ in range(4):
            buf.check_room()
            buf.begin_layer(torch.tensor(ROWS[0]), 4096)
    buf.reset_slots()
    assert buf.depth == [0] and buf.cursors.tolist() == [[0, 0]]
    with pytest.raises(RuntimeError, match="reset after its forward"):
        buf.end_layer(d)


def test_buffer_bytes_equal_the_plan():
    for kw in (dict(), dict(activation_factor=0.3, max_layers_per_slot=3, num_slots=2),
               dict(hidden=96, ffn=32, activation_bytes=1 << 20)):
        base = dict(hidden=64, ffn=128, num_experts=8, top_k=2, max_tokens=24, row_block=16)
        cfg = dm.MoEConfig(**{**base, **kw})
        for ep in (1, 2, 4):
            buf = ActivationBuffer(cfg, ep, 0, torch.device("cpu"))
            plan = dm.plan_memory(cfg, ep)
            assert buf.storage.numel() * buf.storage.element_size() == \
                plan.activation_buffer_bytes
            # the scratch views lie inside the plan's scratch region
            for name, view in buf.scratch.items():
                lo = view.data_ptr() - buf.storage.data_ptr()
                assert plan.slots_bytes <= lo
                assert lo + view.numel() * 2 <= plan.activation_buffer_bytes, name


def test_end_layer_kernel_matches_torch_ops():
    """The backward's rewind (slot_cursor.end_layer_on_device): the Triton program against the
    torch ops on the top layer (rewinds), a lower layer (error code 4, nothing moves) and a
    forward whose selection was invalid (nothing moves, no error)."""
    from distmoe.kernels.movement import slot_cursor as sc

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    for where, want_code in (([1, 2, 1], 0), ([1, 0, 1], 4), ([7, 0, 0], 0)):
        cursors = torch.randint(0, 1 << 20, (3, 2), generator=gen).to(dev)
        depth = torch.tensor([1, 3, 0], device=dev)
        before = torch.randint(0, 1 << 20, (2,), generator=gen).to(dev)
        errors = torch.zeros(4, dtype=torch.int64, device=dev)
        runs = []
        for kernel in (True, False):
            state = [cursors.clone(), depth.clone(), errors.clone()]
            sc.end_layer_on_device(torch.tensor(where, device=dev), before, *state,
                                   kernel=kernel)
            runs.append(state)
        for a, b in zip(*runs, strict=True):
            assert torch.equal(a, b), where
        got_cursors, got_depth, got_errors = runs[0]
        if where == [1, 2, 1]:
            assert torch.equal(got_cursors[1], before) and got_depth.tolist() == [1, 2, 0]
        else:
            assert torch.equal(got_cursors, cursors) and torch.equal(got_depth, depth)
        assert got_errors.tolist() == ([1, 4, 1, 0] if want_code else [0, 0, 0, 0])


def test_slot_arguments_are_checked():
    cfg = dm.MoEConfig(hidden=64, ffn=64, num_experts=4, top_k=2, max_tokens=8, num_slots=2)
    buf = ActivationBuffer(cfg, 1, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"slot \(2\) must lie in \[0, num_slots=2\)"):
        buf.select_slot(2)
    with pytest.raises(TypeError, match="slot must be an int"):
        buf.select_slot(1.0)
    with pytest.raises(ValueError, match="host-backed"):
        ActivationBuffer(dm.MoEConfig(hidden=64, ffn=64, num_experts=4, top_k=2, max_tokens=8,
                                      total_scratch_factor=4.0), 1, 0, torch.device("cpu"))


# ----------------------------------------------------------------------------- stacks on ranks

D, F, T, E, K, BLOCK = 32, 32, 12, 8, 2, 16
LAYERS = ["balanced", "imbalance_8x", "inactive_mix", "all_to_one_expert", "balanced",
          "zero_live_tokens_on_last_rank"]


def _layers(world):
    """The stack's cases on ``world`` ranks. On one rank the last rank is the only one, and a
    layer without live tokens would zero the output and every gradient (a stack that cannot
    tell right from wrong): an 8x imbalance instead."""
    return LAYERS if world > 1 else [
        "imbalance_8x" if n == "zero_live_tokens_on_last_rank" else n for n in LAYERS]


def _assert_nontrivial(runs):
    """Every rank's y and every gradient nonzero on some rank: a comparison of these stacks
    can fail."""
    assert max(r["y"].abs().max().item() for r in runs) > 0
    for i in range(len(runs[0]["grads"])):
        assert max(r["grads"][i].abs().max().item() for r in runs) > 0, f"gradient {i} is 0"


def _cfg(world, layers, *, num_slots=1, mode="mixed", save_route_outputs=True,
         save_gathered_rows=True, in_place=None):
    base = dict(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, row_block=BLOCK,
                device_scratch_factor=float(world), max_layers_per_slot=layers,
                num_slots=num_slots, save_route_outputs=save_route_outputs,
                save_gathered_rows=save_gathered_rows, gathered_rows_in_place=in_place)
    # the same bytes whether saved layers keep their gathered rows or their input
    plan = dm.plan_memory(dm.MoEConfig(**{**base, "save_gathered_rows": True,
                                          "gathered_rows_in_place": None}), world)
    if mode == "save":
        cap = plan.useful_max_slot_bytes
    elif mode == "x4":  # balanced rows: four layers' x states and two inputs (three rows)
        cap = (4 * kept_x_state_bytes(dm.MoEConfig(**base), world, T * K)
               + (layers - 4) * plan.input_bytes)
    else:  # between the inputs-only minimum and the balanced full save
        cap = (plan.min_slot_bytes + plan.balanced_slot_bytes) // 2
    return dm.MoEConfig(**base, activation_bytes=cap)


def _stack_rank(rank, world, seed, mode, checkpointed=None, save_route_outputs=True,
                save_gathered_rows=True, in_place=None):
    """``checkpointed``: {layer: use_reentrant} for layers run under torch.utils.checkpoint."""
    checkpointed = checkpointed or {}
    cfg = _cfg(world, len(LAYERS), mode=mode, save_route_outputs=save_route_outputs,
               save_gathered_rows=save_gathered_rows, in_place=in_place)
    problems = [split_global_problem(*make_problem(seed + i, world, T, D, F, E, K, name),
                                     world)[rank] for i, name in enumerate(_layers(world))]
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(world * T, D, generator=g).bfloat16()[rank * T:(rank + 1) * T]
    with dm.MoEContext(cfg, device="cpu") as ctx:
        x = problems[0].x.clone().requires_grad_(True)
        leaves, replays, kept, h = [x], [], [], x
        for i, p in enumerate(problems):
            s, a, b = (t.clone().requires_grad_(True) for t in (p.scores, p.w13, p.w2))
            leaves += [s, a, b]
            if i in checkpointed:
                h = ckpt.checkpoint(ctx, h, p.expert_ids, s, a, b,
                                    use_reentrant=checkpointed[i])
            else:
                h = ctx(h, p.expert_ids, s, a, b)
                replays.append(bool(h.grad_fn.record.replay))
                flags = h.grad_fn.record.flags.tolist()
                kept.append("input" if flags[0] else "x" if flags[1] else "rows")
        (h.float() * gy.float()).sum().backward()
        all_stats = ctx.stats()
        stats = all_stats["activations"]
        return dict(y=h.detach(), grads=[t.grad for t in leaves], replays=replays, kept=kept,
                    depth=stats["slot_depth"], cursors=stats["slot_cursors"],
                    always_saves=stats["always_saves"], regathers=stats["regathers"],
                    rows_in_place=stats["rows_in_place"], calls=all_stats["calls"],
                    may_regather=stats["may_regather"],
                    buffer=stats["activation_buffer_bytes"])


@functools.cache
def _stack_runs(world, *args):
    """``dm.launch(_stack_rank, world, args=(seed, ...))``, once per process: the stack tests
    compare against the same few runs (the saved reference, the default mixed slot), which
    cost seconds each under the interpreter. The tests only read the results."""
    return dm.launch(_stack_rank, world, args=args)


# one worker runs the stack tests (./run test: --dist loadgroup), so the runs above are shared
stack_group = pytest.mark.xdist_group("activation_stack")


@stack_group
def test_six_layer_stack_replay_is_bit_identical_to_save_all():
    seed, world = 99, 2
    saved = _stack_runs(world, seed, "save")
    _assert_nontrivial(saved)
    mixed = _stack_runs(world, seed, "mixed")
    checkpointed = dm.launch(_stack_rank, world,
                             args=(seed, "mixed", {2: True, 4: False}))
    for rank in range(world):
        s, m, c = saved[rank], mixed[rank], checkpointed[rank]
        assert s["always_saves"] and not any(s["replays"])
        assert not m["always_saves"]
        assert any(m["replays"]) and not all(m["replays"]), m["replays"]
        # every rank took the same decisions (worst-rank rule)
        assert m["replays"] == mixed[0]["replays"]
        # the reentrant layer ran twice (without grad, then recomputed in backward); the
        # non-reentrant one once (it saves no tensors through autograd, so no recompute)
        assert m["calls"] == len(LAYERS) and c["calls"] == len(LAYERS) + 1
        for run in (m, c):
            assert torch.equal(run["y"], s["y"])
            for i, (ga, gb) in enumerate(zip(run["grads"], s["grads"], strict=True)):
                assert ga is not None and torch.equal(ga, gb), f"gradient {i} differs"
            assert run["depth"] == [0] and run["cursors"] == [[0, 0]]  # all rewound


@stack_group
def test_stack_without_route_outputs_in_the_slot_gives_the_same_bits():
    """save_route_outputs=False: saved layers keep x_rows and h1 only (their h3 returns to
    the combine buffer), slots hold more layers whole in the same bytes; the outputs and every
    gradient are bit-identical to the default, saved or replayed."""
    seed, world = 99, 2
    saved = _stack_runs(world, seed, "save")
    _assert_nontrivial(saved)
    for mode in ("save", "mixed"):
        lean = dm.launch(_stack_rank, world, args=(seed, mode, None, False))
        for rank in range(world):
            s, m = saved[rank], lean[rank]
            if mode == "save":
                assert m["always_saves"] and not any(m["replays"])
            assert torch.equal(m["y"], s["y"])
            for i, (ga, gb) in enumerate(zip(m["grads"], s["grads"], strict=True)):
                assert ga is not None and torch.equal(ga, gb), f"{mode}: gradient {i} differs"
            assert m["depth"] == [0] and m["cursors"] == [[0, 0]]


@stack_group
@pytest.mark.parametrize("world", [1, 2])
def test_stack_regathering_rows_gives_the_same_bits(world):
    """save_gathered_rows=False: saved layers keep their input instead of their gathered
    rows, which the backward gathers again (copied into scratch, or at EP = 1 with
    gathered_rows_in_place read in place by the W13 WGRAD); outputs and every gradient are
    bit-identical to the default, saved or replayed (and with the route results dropped
    too). At EP = 1 a saved layer keeps T rows instead of T*K, so the same mixed slot saves a
    longer run of layers whole."""
    seed = 99
    saved = _stack_runs(world, seed, "save")
    _assert_nontrivial(saved)
    default_mixed = _stack_runs(world, seed, "mixed")
    # the route results dropped too: at EP 2 (one launch fewer at EP 1, where the rows read
    # in place take its place)
    runs = [("save", False, None), ("mixed", False, None)]
    if world == 1:  # in place (the rule copies at these few rows per expert)
        runs += [("save", False, True), ("mixed", False, True)]
    else:
        runs += [("mixed", True, None)]
    buffers = {}
    for mode, drop, in_place in runs:
        regather = dm.launch(_stack_rank, world,
                             args=(seed, mode, None, not drop, False, in_place))
        for rank in range(world):
            s, m = saved[rank], regather[rank]
            assert m["regathers"] and not s["regathers"]
            assert m["rows_in_place"] is bool(in_place) and not s["rows_in_place"]
            buffers[mode, drop, in_place] = m["buffer"]
            if mode == "save":
                assert m["always_saves"] and not any(m["replays"])
            else:
                assert any(m["replays"]) and not all(m["replays"]), m["replays"]
                if world == 1 and not drop:  # the first replay comes later
                    first = default_mixed[rank]["replays"].index(True)
                    assert m["replays"].index(True) > first, m["replays"]
            assert torch.equal(m["y"], s["y"])
            for i, (ga, gb) in enumerate(zip(m["grads"], s["grads"], strict=True)):
                assert ga is not None and torch.equal(ga, gb), f"{mode}: gradient {i} differs"
            assert m["depth"] == [0] and m["cursors"] == [[0] * world]
    for mode, drop, in_place in runs:  # in place: no scratch copy of the rows (same slot)
        if in_place:
            assert buffers[mode, drop, in_place] < buffers[mode, drop, None]


def _slots_rank(rank, world, seed):
    """Layer A in slot 0, layer B in slot 1, slot 0 reselected before the backward: each
    backward must use the slot its forward recorded."""
    two = _cfg(world, 1, num_slots=2, mode="save")
    one = _cfg(world, 2, mode="save")
    problems = [split_global_problem(*make_problem(seed + i, world, T, D, F, E, K, name),
                                     world)[rank] for i, name in enumerate(LAYERS[:2])]
    out = {}
    for label, cfg in (("two_slots", two), ("one_slot", one)):
        with dm.MoEContext(cfg, device="cpu") as ctx:
            x = problems[0].x.clone().requires_grad_(True)
            ws = [(p.w13.clone().requires_grad_(True), p.w2.clone().requires_grad_(True))
                  for p in problems]
            y = ctx(x, problems[0].expert_ids, problems[0].scores, *ws[0])
            if label == "two_slots":
                with pytest.raises(ValueError, match="slot 0 already holds 1 layers"):
                    ctx(y, problems[1].expert_ids, problems[1].scores, *ws[1])
                ctx.select_slot(1)
            y = ctx(y, problems[1].expert_ids, problems[1].scores, *ws[1])
            if label == "two_slots":
                ctx.select_slot(0)
                assert y.grad_fn.record.slot == 1
            y.float().square().sum().backward()
            out[label] = [x.grad] + [w.grad for pair in ws for w in pair]
            # an output computed with grad and dropped (no backward) keeps its layer until
            # reset_slots (on every rank)
            ctx(x, problems[0].expert_ids, problems[0].scores, *ws[0])
            out[label + "_dropped"] = ctx.stats()["activations"]["slot_depth"]
            ctx.reset_slots()
            out[label + "_depth"] = ctx.stats()["activations"]["slot_depth"]
    return out


def test_backward_uses_the_slot_its_forward_recorded():
    for r in dm.launch(_slots_rank, 2, args=(5,)):
        for a, b in zip(r["two_slots"], r["one_slot"], strict=True):
            assert torch.equal(a, b)
        assert r["two_slots_dropped"] == [1, 0] and r["one_slot_dropped"] == [1]
        assert r["two_slots_depth"] == [0, 0] and r["one_slot_depth"] == [0]


@pytest.mark.parametrize("mode", [True, False, "auto"], ids=["x_rows", "kept_x", "auto"])
@pytest.mark.parametrize("h3_bytes", [2048, 0], ids=["route_outputs", "no_route_outputs"])
@pytest.mark.parametrize("ep", [1, 3, 8])
def test_slot_cursor_kernel_matches_torch_ops(ep, h3_bytes, mode):
    """The one-program decision (the device path, interpreted on CPU) against the same rule
    in torch ops, on random rows and cursors that straddle the save/replay boundary, with row
    byte counts that are not multiples of 128 (the rounding matters). ``mode``: saved layers
    keep x_rows, the input (1536 B) instead (``save_gathered_rows`` False), or either
    (``"auto"``); the host planner's rule (``_decide``) must agree with both."""
    from distmoe.kernels.movement import slot_cursor as sc
    from distmoe.memory.planner import _decide

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(ep + 17 * (h3_bytes > 0))
    outcomes = set()
    for trial in range(32):
        rows = torch.randint(0, 100, (ep,), generator=gen).to(dev)  # x smaller from 20
        cursors = (torch.randint(0, 200, (ep,), generator=gen) * 128).to(dev)
        later = trial % 4
        layer = trial % 3  # the slot's depth before the layer: read on the device
        args = dict(rank=trial % ep, input_bytes=1536, max_layers=layer + later + 1 + trial % 2,
                    # room for this layer's input and the later ones' (the invariant), and
                    # up to 16 KB more: saves of both states, and replays
                    slot_bytes=int(cursors.max()) + 1536 * (later + 1)
                    + int(torch.randint(0, 16_000, (1,), generator=gen)),
                    mode=mode, h3_bytes=h3_bytes, x_row_bytes=2 * 40, kept_x_bytes=1536,
                    h1_row_bytes=2 * 2 * 24, combine_address=7 * 4096,
                    elements_address=11 * 4096, replay_offsets=(12_288, 20_480),
                    act_bases=(torch.randint(1, 1 << 20, (ep,), generator=gen) * 4096).to(dev),
                    combine_bases=(torch.randint(1, 1 << 20, (ep,), generator=gen) * 4096).to(dev),
                    rows_origin=13 * 4096)
        args["slot_base"] = 3 * args["slot_bytes"]  # slot 3 of 5 is selected
        # every slot's cursors (poison in the others: they must not move), the selection
        # (slot 3, bound layer + later + 1), the depths and a clean error record
        state = [torch.randint(0, 1 << 30, (5, ep), generator=gen).to(dev),
                 torch.tensor([3, layer + later + 1], device=dev),
                 torch.tensor([9, 0, 4, layer, 2], device=dev),
                 torch.zeros(4, dtype=torch.int64, device=dev)]
        state[0][3] = cursors
        call = {k: v for k, v in args.items() if k != "slot_base"}
        want_state = [t.clone() for t in state]
        want = [torch.full((ep,), -7, dtype=torch.int64, device=dev),
                torch.ones(1, dtype=torch.bool, device=dev),
                torch.full((4,), -7, dtype=torch.int64, device=dev),
                torch.full((5,), -7, dtype=torch.int64, device=dev),
                torch.full((ep,), -7, dtype=torch.int64, device=dev),
                torch.full((3,), -7, dtype=torch.int32, device=dev)]
        want_where = torch.full((3,), -7, dtype=torch.int64, device=dev)
        sc._begin_layer_torch(rows, *want_state, want_where, *want, num_slots=5, **call)
        got_state = [t.clone() for t in state]
        # the Triton program itself (on a CPU device: in the interpreter), never the torch ops
        *got, where = sc.begin_layer_on_device(rows, *got_state, **call, kernel=True)
        for g, w in zip(got_state, want_state, strict=True):
            assert torch.equal(g, w)
        assert where.tolist() == want_where.tolist() == [3, layer, 1]
        assert got_state[2].tolist() == [9, 0, 4, layer + 1, 2] and not got_state[3].any()
        assert torch.equal(got_state[0][[0, 1, 2, 4]], state[0][[0, 1, 2, 4]])
        got_cur = got_state[0][3]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (trial, g, w)
        replayed, as_x, rebuild = got[5].tolist()
        assert replayed == bool(got[1]) and rebuild == (replayed or as_x)
        assert not (replayed and as_x)
        outcomes.add("input" if replayed else "x" if as_x else "rows")
        # the host planner's rule on the same bytes: the cursors kept before the layer and
        # `later` layers after it (their bytes do not matter to this one)
        rest = (rows.cpu() * 96 + 127) // 128 * 128 + h3_bytes
        rows_state = (rows.cpu() * 80 + 127) // 128 * 128 + rest
        x_state = 1536 + rest
        full = [(x_state if mode is False else rows_state).tolist()] + [[0] * ep] * later
        xs = [x_state.tolist()] + [[0] * ep] * later if mode == "auto" else None
        decisions, _, history, kept_x = _decide(full, 1536, args["slot_bytes"], xs,
                                                saved=cursors.cpu().tolist())
        assert decisions[0] == (not replayed)
        assert kept_x[0] == (bool(as_x) and mode == "auto")  # _decide marks auto's choice
        if mode != "auto":  # the fixed modes: x kept by every saved layer, or by none
            assert bool(as_x) == (not replayed and mode is False)
        assert list(history[0]) == got_cur.tolist()
        assert got_cur.max().item() + 1536 * later <= args["slot_bytes"]  # never past it
        # every rank's h3 rows: its activation buffer + slot + cursor + x_rows (or x) + h1
        x_kept = torch.full_like(rows, 1536) if as_x or mode is False else (rows * 80 + 127) \
            // 128 * 128
        saved_at = (args["act_bases"] + args["slot_base"] + cursors + x_kept
                    + (rows * 96 + 127) // 128 * 128 - args["combine_bases"])
        saved = (~got[1]).long() * (h3_bytes > 0)
        assert torch.equal(got[4], saved_at * saved)
        if h3_bytes == 0:  # no route results in the slot: h3 offset -1, combine address
            assert got[2][2].item() == -1 and got[3][0].item() == args["combine_address"]
        if as_x or replayed:  # no x_rows, the input kept, the rows read from scratch xs
            assert got[2][1].item() == -1 and got[2][3].item() >= 0
            assert got[3][2].item() == args["replay_offsets"][1]
        else:  # the rows kept at the cursor, no input
            assert got[2][1].item() == (args["slot_base"] + cursors[args["rank"]].item()) // 2
            assert got[2][3].item() == -1
        # the in-place WGRAD's x_offset: the state's start, and the table origin where the
        # rows were kept (read in order), else 0 (x's rows through the table)
        start = (args["slot_base"] + cursors[args["rank"]].item()) // 2
        kept_rows = not (as_x or replayed)
        assert got[3][3:].tolist() == [start, args["rows_origin"] if kept_rows else 0]
    want = {True: {"rows", "input"}, False: {"x", "input"}, "auto": {"rows", "x", "input"}}
    assert outcomes == want[mode], outcomes  # every way a layer can go was compared


@stack_group
@pytest.mark.parametrize("world", [1, 2])
def test_stack_choosing_rows_or_x_gives_the_same_bits(world):
    """save_gathered_rows='auto': in the mixed slot each layer keeps its rows, x (its backward
    gathers the rows again, turned on by the device for that layer only) or its input; the
    outputs and every gradient are bit-identical to the default with every layer saved. The
    slot has room for about four balanced layers' x or three layers' rows. With room for
    every layer's rows, all keep them and the backward never regathers. At EP = 1 with
    gathered_rows_in_place the W13 WGRAD reads x's rows through the table and kept rows in
    order, in one launch (the same bits again)."""
    seed = 99
    saved = _stack_runs(world, seed, "save")
    _assert_nontrivial(saved)
    roomy = dm.launch(_stack_rank, world, args=(seed, "save", None, True, "auto"))
    mixed = dm.launch(_stack_rank, world, args=(seed, "x4", None, True, "auto"))
    rows_mode = dm.launch(_stack_rank, world, args=(seed, "x4"))
    runs = [(roomy, False), (mixed, False)]
    if world == 1:  # the rows read in place: x's through the table, kept rows in order
        # (the mixed slot keeps both kinds, asserted below)
        runs += [(dm.launch(_stack_rank, 1, args=(seed, "x4", None, True, "auto", True)),
                  True)]
    for run, in_place in runs:
        for rank in range(world):
            assert run[rank]["rows_in_place"] is in_place
            assert torch.equal(run[rank]["y"], saved[rank]["y"])
            for i, (ga, gb) in enumerate(zip(run[rank]["grads"], saved[rank]["grads"],
                                             strict=True)):
                assert ga is not None and torch.equal(ga, gb), f"gradient {i} differs"
            assert run[rank]["depth"] == [0] and run[rank]["cursors"] == [[0] * world]
            if in_place:  # the same choices as with the rows copied
                assert run[rank]["kept"] in (mixed[rank]["kept"], roomy[rank]["kept"])
    for rank in range(world):
        r, m = roomy[rank], mixed[rank]
        assert r["kept"] == ["rows"] * len(LAYERS) and not r["may_regather"]
        assert m["may_regather"] and not m["regathers"] and not m["rows_in_place"]
        assert m["kept"] == mixed[0]["kept"]  # every rank decided the same
        assert m["replays"] == [k == "input" for k in m["kept"]]
        # fewer replays than the default slot of the same bytes
        assert m["replays"].count(True) <= rows_mode[rank]["replays"].count(True)
        if world == 1:  # T rows of x against T*K gathered rows: x kept where rows do not fit
            assert "x" in m["kept"] and "rows" in m["kept"], m["kept"]
