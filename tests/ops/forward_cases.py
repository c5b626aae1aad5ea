"""Routing cases and a rank function shared by the CPU and GPU forward tests."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import distmoe as dm
from distmoe.reference import moe_reference, random_routing, split_global_problem

# name -> builder(generator, EP, T, E, K) -> (ids [EP*T, K], scores [EP*T, K])
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def balanced(g, EP, T, E, K):
    return random_routing(EP * T, E, K, generator=g)


@case
def imbalance_8x(g, EP, T, E, K):
    # Rank 0's experts get most routes: each route goes there with probability ~8/EP-ish.
    ids, scores = random_routing(EP * T, E, K, generator=g)
    E_local = E // EP
    hot = torch.rand(EP * T, K, generator=g) < min(1.0, 8.0 / max(EP, 1) - 0.01)
    local_choice = torch.randint(0, E_local, (EP * T, K), generator=g)
    ids = torch.where(hot, local_choice, ids)
    # keep experts distinct per token: where a duplicate appears, disable the later route
    for k in range(1, K):
        dup = (ids[:, k:k + 1] == ids[:, :k]).any(1)
        ids[dup, k] = -1
        scores[dup, k] = 0
    return ids, scores


@case
def all_to_one_expert(g, EP, T, E, K):
    ids = torch.full((EP * T, K), -1)
    ids[:, 0] = E - 1
    scores = torch.zeros(EP * T, K)
    scores[:, 0] = torch.rand(EP * T, generator=g) + 0.5
    return ids, scores


@case
def inactive_mix(g, EP, T, E, K):
    ids, scores = random_routing(EP * T, E, K, generator=g, inactive_fraction=0.4)
    ids[1] = -1  # one all-inactive token
    scores[1] = 0
    return ids, scores


@case
def zero_live_tokens_on_last_rank(g, EP, T, E, K):
    ids, scores = random_routing(EP * T, E, K, generator=g)
    ids[(EP - 1) * T:] = -1
    scores[(EP - 1) * T:] = 0
    return ids, scores


def make_problem(seed, EP, T, D, F, E, K, case_name):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(EP * T, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    ids, scores = CASES[case_name](g, EP, T, E, K)
    return x, ids, scores.float(), w13, w2


def _rank_device(device):
    """The rank's device: the CPU, or the CUDA device ``dm.launch`` made current for it."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def forward_rank(rank, world, seed, T, D, F, E, K, case_name, device="cpu", row_block=16,
                 max_tokens=None, pull_all=None, w13_phases=None):
    """Run the layer on this rank; returns (y, stats) for the parent to check (stats adds
    ``w13_phased``: whether W13 ran in two launches). ``pull_all``: force the EP > 1 token
    pull's way (every peer token, or those the tables name); ``w13_phases``: force W13's
    two launches on or off; None keeps the layer's choice."""
    x, ids, scores, w13, w2 = make_problem(seed, world, T, D, F, E, K, case_name)
    mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=max_tokens or T,
                       training=False, row_block=row_block,
                       device_scratch_factor=float(world))  # room for any imbalance
    dev = _rank_device(device)
    layer = {k: v for k, v in (("pull_all", pull_all), ("w13_phases", w13_phases))
             if v is not None}
    with dm.MoEContext(cfg, device=dev, check=True, overrides={"layer": layer}) as ctx:
        args = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores, mine.w13, mine.w2)]
        y = ctx(*args)
        stats = dict(ctx.stats(), w13_phased=ctx._phased_w13())
        if stats["w13_phased"]:
            stats["w13_positions"] = ctx._w13_positions.tolist()
        # a second call with the same inputs gives the same bits (buffer reuse is clean)
        y2 = ctx(*args)
        assert torch.equal(y, y2), "second call differs"
    return y.cpu(), stats


def x_in_place_rank(rank, world, seed, T, D, F, E, K, case_name):
    """EP = 1 on CPU: the forward reads x in place (the dispatch buffer stays as allocated,
    zero), and from a copy in the dispatch buffer when x's rows are not 16-byte aligned;
    returns (y in place, y from a misaligned x, dispatch written after each, stats)."""
    args = make_problem(seed, world, T, D, F, E, K, case_name)
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, training=False,
                       row_block=16)
    with dm.MoEContext(cfg, device="cpu", check=True) as ctx:
        y = ctx(*args)
        written = [bool(ctx._dispatch[:T].view(torch.int16).ne(0).any())]
        flat = torch.empty(T * D + 1, dtype=torch.bfloat16)
        x_odd = flat[1:].view(T, D)  # 2 bytes off: not 16-byte aligned
        x_odd.copy_(args[0])
        y_odd = ctx(x_odd, *args[1:])
        written.append(bool(ctx._dispatch[:T].view(torch.int16).ne(0).any()))
        stats = ctx.stats()
    return y.cpu(), y_odd.cpu(), written, stats


class _CopyTargets(TorchDispatchMode):
    """Records the data pointer of every tensor an ``aten.copy_`` writes (a real dispatch
    mode over the real ops: nothing is replaced)."""

    def __init__(self):
        super().__init__()
        self.targets = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.targets.append(args[0].data_ptr())
        return func(*args, **(kwargs or {}))


def input_buffer_rank(rank, world, seed, T, D, F, E, K, case_name, max_tokens, device="cpu"):
    """x written into ``ctx.input_buffer(T)`` against x passed as its own tensor, for two
    inputs (the second one new rows in the same buffer). Returns, per input, (y from x,
    y from the buffer, whether a copy wrote the buffer's first row in each call)."""
    x, ids, scores, w13, w2 = make_problem(seed, world, T, D, F, E, K, case_name)
    mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=max_tokens,
                       training=False, row_block=16, device_scratch_factor=float(world))
    g = torch.Generator().manual_seed(seed + 100 + rank)
    dev = _rank_device(device)
    out = []
    with dm.MoEContext(cfg, device=dev, check=True) as ctx:
        buf = ctx.input_buffer(T)
        assert buf.shape == (T, D) and buf.dtype == torch.bfloat16
        rest = [t.to(dev) for t in (mine.expert_ids, mine.scores, mine.w13, mine.w2)]
        for xi in (mine.x.to(dev), torch.randn(T, D, generator=g).bfloat16().to(dev)):
            ctx._dispatch.fill_(float("nan"))  # poison: rows the forward should not read
            with _CopyTargets() as plain:
                y = ctx(xi.clone(), *rest)
            ctx._dispatch.fill_(float("nan"))
            buf.copy_(xi)  # the caller writes its input into the buffer
            with _CopyTargets() as inbuf:
                y_buf = ctx(buf, *rest)
            base = ctx._dispatch.data_ptr()
            out.append((y.cpu(), y_buf.cpu(), [base in plain.targets, base in inbuf.targets]))
    return out


def check_input_buffer_ranks(per_rank, seed, EP, T, D, F, E, K, case_name):
    """What :func:`input_buffer_rank` returned, checked: per rank and input, y from the
    buffer equals y from x bit for bit, no copy wrote the buffer, the plain call copied x
    there exactly when EP > 1; the first input's y against the reference."""
    for rank_out in per_rank:
        assert len(rank_out) == 2
        for y, y_buf, (plain_copied, buf_copied) in rank_out:
            assert torch.equal(y.view(torch.int16), y_buf.view(torch.int16))
            assert plain_copied == (EP > 1) and not buf_copied
    check_against_reference([r[0] for r in per_rank], seed, EP, T, D, F, E, K, case_name)


def forward_cases_rank(rank, world, seed, T, D, F, E, K, case_names, device="cpu"):
    """All cases in one launch (spawning ranks costs more than a small case)."""
    return [forward_rank(rank, world, seed, T, D, F, E, K, c, device) for c in case_names]


def check_against_reference(outputs, seed, EP, T, D, F, E, K, case_name):
    x, ids, scores, w13, w2 = make_problem(seed, EP, T, D, F, E, K, case_name)
    y = torch.cat([o[0] for o in outputs])
    y64 = moe_reference(x.double(), ids, scores.double(), w13.double(), w2.double())
    y16 = moe_reference(x, ids, scores, w13, w2)
    # bf16 rule: our error against the fp64 oracle is at most 2x that of the bf16 PyTorch
    # reference (which rounds h1, h2, h3 to bf16 like us), plus one bf16 ulp of slack at |y|~1.
    err = (y.double() - y64).abs().max().item()
    ref_err = (y16.double() - y64).abs().max().item()
    assert err <= 2 * ref_err + 1e-2, f"{case_name}: error {err:.3g} vs bf16 reference {ref_err:.3g}"
    inactive_rows = (ids < 0).all(1)
    assert torch.equal(y[inactive_rows], torch.zeros_like(y[inactive_rows])), "inactive rows"
    return err, ref_err
