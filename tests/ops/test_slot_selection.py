"""Slot selection on the device (issue 62, item 3): a 1F1B schedule over two local pipeline
stages with slots from ``assign_slots``, selected with host ints or with device tensors, gives
the same gradients bit for bit as running each microbatch's forward and backward alone; a
device selection the forward finds invalid is reported, never written out of bounds;
``reset_slots`` refuses while a backward still owns state."""

import pytest
import torch
from forward_cases import make_problem

import distmoe as dm
from distmoe.memory.slots import assign_slots, interleaved_1f1b, stage_lifetimes
from distmoe.reference import split_global_problem

DIMS = dict(T=8, D=32, F=32, E=4, K=2)
T, D, F, E, K = DIMS.values()
STAGES, MICROBATCHES = 2, 4


def _cfg(world, num_slots, layers=1, dims=DIMS):
    return dm.MoEConfig(hidden=dims["D"], ffn=dims["F"], num_experts=dims["E"],
                        top_k=dims["K"], max_tokens=dims["T"], row_block=16,
                        device_scratch_factor=float(world), num_slots=num_slots,
                        max_layers_per_slot=layers)


def schedule():
    """The actions of one rank owning both stages (two chunks), and each (stage, microbatch)
    owner's slot from the greedy colouring."""
    actions = interleaved_1f1b(num_ranks=1, num_chunks=STAGES, num_microbatches=MICROBATCHES,
                               rank=0)
    lifetimes = stage_lifetimes(actions)
    owners = sorted(lifetimes, key=lambda k: lifetimes[k][0])
    slots = assign_slots([lifetimes[k] for k in owners])
    return actions, dict(zip(owners, slots.slot_ids, strict=True)), slots.num_slots


def _problems(rank, world, seed, dims=DIMS):
    """``[stage][microbatch]`` rank inputs: the stage's weights are its microbatch 0's; the
    first stage's x is the input; ids and scores per stage and microbatch."""
    out = []
    for s in range(STAGES):
        mbs = [split_global_problem(*make_problem(seed + 10 * s + m, world, *dims.values(),
                                                  "imbalance_8x" if m % 2 else "balanced"),
                                    world)[rank] for m in range(MICROBATCHES)]
        out.append(mbs)
    return out


def run_schedule(ctx, problems, order, slot_of, how):
    """Run ``order`` (actions) on ``ctx``; ``how``: "host" (select_slot with ints), "device"
    (one-element device tensors written before each forward), or "alone" (no schedule: each
    microbatch's forwards then backwards, slot 0). Returns every gradient, in a fixed order."""
    dev = ctx.device
    ws = [(problems[s][0].w13.clone().requires_grad_(True),
           problems[s][0].w2.clone().requires_grad_(True)) for s in range(STAGES)]
    xs, ys, grads = {}, {}, {}
    selected = torch.zeros(1, dtype=torch.int64, device=dev)
    if how == "alone":
        order = [a for m in range(MICROBATCHES) for a in
                 [dm.memory.slots.Action("F", s, m) for s in range(STAGES)]
                 + [dm.memory.slots.Action("B", s, m) for s in reversed(range(STAGES))]]
    for act in order:
        s, m = act.stage, act.microbatch
        p = problems[s][m]
        if act.kind == "F":
            if how == "host":
                ctx.select_slot(slot_of[s, m])
            elif how == "device":
                selected.fill_(slot_of[s, m])  # what a framework's schedule table would hold
                ctx.select_slot(selected)
            x = (p.x.clone() if s == 0 else ys[s - 1, m].detach()).requires_grad_(True)
            xs[s, m] = x
            ys[s, m] = ctx(x, p.expert_ids, p.scores, *ws[s])
        else:
            gy = problems[s][m].x.flip(0) * 0.5 if s == STAGES - 1 else xs[s + 1, m].grad
            ys[s, m].backward(gy)
            grads[s, m] = xs[s, m].grad
            del ys[s, m]  # its graph goes: nothing owns the layer's state any more
    return [grads[0, m] for m in range(MICROBATCHES)] + [w.grad for pair in ws for w in pair]


def _schedule_rank(rank, world, seed):
    problems = _problems(rank, world, seed)
    order, slot_of, num_slots = schedule()
    out = {}
    with dm.MoEContext(_cfg(world, num_slots), device="cpu") as ctx:
        for how in ("host", "device"):
            out[how] = run_schedule(ctx, problems, order, slot_of, how)
            stats = ctx.stats()["activations"]
            out[how + "_left"] = (stats["slot_depth"], stats["slot_cursors"],
                                  stats["slot_errors"])
    with dm.MoEContext(_cfg(world, 1, layers=STAGES), device="cpu") as ctx:
        out["alone"] = run_schedule(ctx, problems, order, slot_of, "alone")
    out["num_slots"] = num_slots
    return out


@pytest.mark.parametrize("world", [2])
def test_1f1b_with_device_selection_matches_each_microbatch_alone(world):
    _, slot_of, num_slots = schedule()
    assert num_slots > 1 and len(set(slot_of.values())) == num_slots  # slots are reused
    for r in dm.launch(_schedule_rank, world, args=(3,)):
        for how in ("host", "device"):
            assert len(r[how]) == len(r["alone"])
            for i, (a, b) in enumerate(zip(r[how], r["alone"], strict=True)):
                assert a is not None and a.abs().sum() > 0, (how, i)  # never all zero
                assert torch.equal(a, b), f"{how}: gradient {i} differs from the lone runs"
            depth, cursors, errors = r[how + "_left"]
            assert depth == [0] * num_slots and errors == [0, 0, 0, 0]
            assert cursors == [[0] * world] * num_slots


def _invalid_rank(rank, world):
    p = split_global_problem(*make_problem(7, world, T, D, F, E, K, "balanced"), world)[rank]
    out = {}
    with dm.MoEContext(_cfg(world, 2, layers=2), device="cpu") as ctx:
        w13, w2 = p.w13.clone().requires_grad_(True), p.w2.clone().requires_grad_(True)
        x = p.x.clone().requires_grad_(True)
        acts = ctx.activations
        poison = acts.storage.clone()
        # slot 5 of 2, selected on the device: nothing written anywhere, the error counted
        ctx.select_slot(torch.tensor([5]))
        y = ctx(x, p.expert_ids, p.scores, w13, w2)
        out["untouched"] = torch.equal(acts.storage[:acts.plan.slots_bytes],
                                       poison[:acts.plan.slots_bytes])
        out["after_bad_slot"] = ctx.stats()["activations"]["slot_errors"]
        with pytest.raises(RuntimeError, match="outside \\[0, num_slots\\)"):
            ctx(x, p.expert_ids, p.scores, w13, w2)  # the next forward reports it
        with pytest.raises(RuntimeError, match="still owned"):
            ctx.reset_slots()
        del y
        ctx.reset_slots()  # and clears the record
        # a bound of one layer given on the device: the second layer in the slot is refused
        ctx.select_slot(0, max_layers=torch.tensor([1]))
        y1 = ctx(x, p.expert_ids, p.scores, w13, w2)
        y2 = ctx(x, p.expert_ids, p.scores, w13, w2)
        out["full"] = ctx.stats()["activations"]["slot_errors"]
        out["depth_full"] = ctx.stats()["activations"]["slot_depth"]
        del y1, y2
        ctx.reset_slots()
        # the same bound as a host int is refused before anything runs
        ctx.select_slot(1, max_layers=1)
        y1 = ctx(x, p.expert_ids, p.scores, w13, w2)
        with pytest.raises(ValueError, match=r"max_layers=1\)"):
            ctx(x, p.expert_ids, p.scores, w13, w2)
        y1.sum().backward()
        out["clean"] = ctx.stats()["activations"]["slot_errors"]
        for bad, kind in ((2, ValueError), (torch.tensor([1.0]), TypeError),
                          (torch.tensor([0, 1]), TypeError), (1.0, TypeError)):
            with pytest.raises(kind, match="slot"):
                ctx.select_slot(bad)
        with pytest.raises(ValueError, match="max_layers"):
            ctx.select_slot(0, max_layers=3)
        # two device-selected layers in slot 1, the lower one's backward first: the host
        # cannot tell (it does not know their slot), the device refuses to rewind and says so
        ctx.select_slot(torch.tensor([1]))
        y1 = ctx(x, p.expert_ids, p.scores, w13, w2)
        y2 = ctx(x, p.expert_ids, p.scores, w13, w2)
        cursors = ctx.stats()["activations"]["slot_cursors"]
        y1.sum().backward()
        out["out_of_order"] = ctx.stats()["activations"]["slot_errors"]
        out["kept"] = (ctx.stats()["activations"]["slot_cursors"] == cursors,
                       ctx.stats()["activations"]["slot_depth"])
        with pytest.raises(RuntimeError, match="out of order"):
            ctx(x, p.expert_ids, p.scores, w13, w2)
        del y2
        ctx.reset_slots()
    return out


def test_invalid_device_selection_is_reported_and_writes_nothing():
    for r in dm.launch(_invalid_rank, 2):
        assert r["untouched"]
        assert r["after_bad_slot"] == [1, 1, 5, 0]  # count, code 1 (slot), slot 5, layer 0
        assert r["full"] == [1, 3, 0, 1] and r["depth_full"] == [1, 0]  # code 3: slot full
        assert r["clean"] == [0, 0, 0, 0]
        assert r["out_of_order"] == [1, 4, 1, 0]  # code 4: layer 0 of slot 1 was not on top
        assert r["kept"] == (True, [0, 2])  # nothing rewound
