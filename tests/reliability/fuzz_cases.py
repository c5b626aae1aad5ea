"""Fuzzed routing cases for the reliability tests: what a case is, how its inputs are built,
which routes a rank executes, the rank functions and the host-side checks.

A :class:`Case` is a small frozen record (it pickles to the ranks); every tensor of a case
is built from it by :func:`make_problem`, the same bits on the host and on every rank. The
host draws cases with hypothesis (fuzz_plan.py, which the ranks do not import), one launch
of EP ranks runs every case of that size (:func:`suite_rank`; :func:`forward_fuzz_rank`
and :func:`training_fuzz_rank` run one list, e.g. a failing case again) and the host checks
what came back (:func:`check_forward`, :func:`check_training`).

Shape legend (one global problem, rank r holds token rows ``r*T .. (r+1)*T - 1`` and
experts ``r*E_local .. (r+1)*E_local - 1``): EP ranks, T tokens per rank, K routes per
token, E = EP * E_local experts, N = EP * T global tokens, D hidden, F ffn.

Which routes run (docs/design.md, "Routing" and "Errors and the receive-bound overflow
rule"), as :func:`expected_routes` computes it independently of ``distmoe.routing``: an id
outside [-1, E) after the cast to the case's id dtype is invalid (counted in
``stats()["invalid_ids"]`` by every rank, never executed); rank r receives every valid
route to its experts and orders them expert-major, keeping (source rank, t, k) order inside
an expert; the first ``R_b`` of them run, the rest are dropped (counted in rank r's
``stats()["dropped_rows"]``, left out of y, zero gradients).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

import distmoe as dm
from distmoe.reference import merge_expert_tensors, moe_reference, split_global_problem

IDS_DTYPES = ("int8", "uint8", "int16", "int32", "int64")
SCORE_DTYPES = ("float32", "bfloat16", "float16", "float64")
#: hidden, ffn and the largest max_tokens drawn, per device (the GPU shapes of
#: tests/ops/test_forward_gpu.py; the CPU ones small for Triton's interpreter)
SHAPES = {"cpu": (32, 32, 32), "cuda": (256, 128, 320)}
#: int16 bits of a bf16 quiet NaN with a payload no kernel computes: poisoned memory
POISON = 0x7FC1
#: byte of the guard regions around every tensor passed to the layer
GUARD_BYTE = 0xA5
#: guard elements on each side of a passed tensor (64 bytes at least: aligned inside)
GUARD = 64
#: invalid ids per id dtype: below -1, E and above, the extremes of the dtype, and ids that
#: a plain cast to int16 would wrap into valid ones (65537 -> 1); ``None`` stands for E
INVALID_IDS = {
    "int8": (-128, -2, None, 127),
    "uint8": (None, 200, 255),  # 255 is also what -1 becomes in uint8
    "int16": (-32768, -2, None, 32767),
    "int32": (-(2**31), -2, None, 65537, 2**31 - 1),
    "int64": (-(2**62), -2, None, 65537, 2**40),
}
#: MoEConfig fields of each training ``Case.saving``
SAVING = {
    "default": {},
    "lean": dict(save_route_outputs=False),
    "regather": dict(save_gathered_rows=False),
    "auto": dict(save_gathered_rows="auto"),
    "in_place": dict(save_gathered_rows=False, gathered_rows_in_place=True),
}
#: the counters of ctx.stats() compared per call (deltas around one call)
COUNTERS = ("dropped_rows", "invalid_ids", "calls", "token_count_mismatches")


@dataclass(frozen=True)
class Case:
    """One fuzzed case: a context on an EP group and its calls (all ranks the same T).

    Attributes:
        seed: seeds every tensor of the case.
        ep: EP ranks.
        experts_per_rank: E_local.
        top_k: K.
        max_tokens: T_max (buffers); ``tokens``: the call's T (0 <= T <= T_max).
        row_block: the padded row block.
        ids_dtype / scores_dtype: dtype names of expert_ids and scores.
        expert_skew: fraction of tokens whose first choice is one hot expert (1.0: every
            token routes to it).
        rank_skew: fraction of tokens that prefer one hot rank's experts.
        inactive: fraction of routes disabled (-1; 255 once cast to uint8: invalid there).
        repeats: fraction of routes that repeat the token's previous id (unchecked calls
            accept them; each route runs on its own).
        invalid: fraction of routes given an id outside [-1, E) (see ``INVALID_IDS``).
        stray_score: the score on disabled and invalid routes (0 by the contract; anything,
            NaN included, is ignored unchecked).
        bound: the receive bound: ``"roomy"`` (a factor of EP*K), ``"exact"`` (R_b = the
            most rows any rank receives), ``"minus_one"`` (one below), ``"tight"``
            (``device_scratch_factor = tight_factor``).
        x_offset: guard elements before x (64: 16-byte aligned; 65: not, so EP = 1 copies x
            into the dispatch buffer instead of reading it in place).
        via_out: the forward writes into a poisoned, guarded output through
            ``ctx.forward_layer(..., out=)`` (the path of the context's CUDA graphs)
            instead of returning a new y.
        activation_factor: training: the slot budget (0: inputs only, every layer replays).
        saving: training: what a saved layer keeps (:data:`SAVING`: the default, no route
            outputs, x instead of the gathered rows, the choice per layer, x's rows read in
            place by the W13 weight gradient).
        then_tokens: a second call on the same context with this T and new tokens and
            routing (seed + 1), under the receive bound of the first (None: one call).
        pull_all: EP > 1: how the peer tokens reach W13 (``overrides={"layer":
            {"pull_all": ...}}``): True every peer token copied, False only those the
            tables name (flags per token, cleared by the copy), None the layer's choice.
        hidden / ffn: D and F.
    """

    seed: int
    ep: int
    experts_per_rank: int
    top_k: int
    max_tokens: int
    tokens: int
    row_block: int = 16
    ids_dtype: str = "int64"
    scores_dtype: str = "float32"
    expert_skew: float = 0.0
    rank_skew: float = 0.0
    inactive: float = 0.0
    repeats: float = 0.0
    invalid: float = 0.0
    stray_score: float = 0.0
    bound: str = "roomy"
    tight_factor: float = 1.0
    x_offset: int = GUARD
    via_out: bool = False
    activation_factor: float = 1.0
    saving: str = "default"
    then_tokens: int | None = None
    pull_all: bool | None = None
    hidden: int = 32
    ffn: int = 32

    @property
    def num_experts(self) -> int:
        return self.ep * self.experts_per_rank

    def calls(self) -> list[Case]:
        """The calls made on this case's context: itself, then its follow-up."""
        if self.then_tokens is None:
            return [self]
        return [self, replace(self, seed=self.seed + 1, tokens=self.then_tokens,
                              then_tokens=None)]

    def short(self) -> str:
        """The fields that differ from the defaults (for messages)."""
        default = Case(seed=0, ep=0, experts_per_rank=0, top_k=0, max_tokens=0, tokens=0)
        diff = {k: v for k, v in asdict(self).items() if v != getattr(default, k)
                or k in ("seed", "ep", "experts_per_rank", "top_k", "max_tokens", "tokens")}
        return "Case(" + ", ".join(f"{k}={v!r}" for k, v in diff.items()) + ")"


# ---------------------------------------------------------------------------- inputs
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def make_problem(case: Case):
    """The global problem of ``case``: x [N, D] bf16, expert_ids [N, K] in the case's id
    dtype, scores [N, K] in its score dtype, w13 [E, 2, F, D] bf16, w2 [E, D, F] bf16."""
    g = torch.Generator().manual_seed(case.seed)
    E, K, EL = case.num_experts, case.top_k, case.experts_per_rank
    N, D, F = case.ep * case.tokens, case.hidden, case.ffn
    x = torch.randn(N, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    noise = torch.rand(N, E, generator=g)
    hot_expert = int(torch.randint(E, (1,), generator=g))
    hot_rank = int(torch.randint(case.ep, (1,), generator=g))
    prefer_rank = torch.rand(N, generator=g) < case.rank_skew
    noise[prefer_rank, hot_rank * EL:(hot_rank + 1) * EL] += 2.0
    prefer_expert = torch.rand(N, generator=g) < case.expert_skew
    noise[prefer_expert, hot_expert] += 4.0
    ids = noise.topk(K, dim=1).indices  # distinct experts per token
    repeat = torch.rand(N, K, generator=g) < case.repeats
    for k in range(1, K):
        ids[:, k] = torch.where(repeat[:, k], ids[:, k - 1], ids[:, k])
    off = torch.rand(N, K, generator=g) < case.inactive
    ids = ids.masked_fill(off, -1)
    bad = (torch.rand(N, K, generator=g) < case.invalid) & ~off
    choices = torch.tensor([E if v is None else v for v in INVALID_IDS[case.ids_dtype]])
    pick = torch.randint(len(choices), (N, K), generator=g)
    ids = torch.where(bad, choices[pick], ids)
    scores = torch.rand(N, K, generator=g) + 0.1
    scores = scores / scores.sum(1, keepdim=True)
    ids = ids.to(_dtype(case.ids_dtype))  # uint8: -1 becomes 255 (invalid)
    scores = scores.masked_fill(~is_valid(ids, E), case.stray_score)
    return x, ids, scores.to(_dtype(case.scores_dtype)), w13, w2


def is_valid(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool, ids' shape: the id names an expert (in [0, E))."""
    v = ids.long()
    return (v >= 0) & (v < num_experts)


def received_rows(ids: torch.Tensor, case: Case) -> list[int]:
    """Valid routes to each rank's experts (executed or not)."""
    v = ids.long()
    dest = torch.where(is_valid(ids, case.num_experts), v // case.experts_per_rank, -1)
    return [int((dest == r).sum()) for r in range(case.ep)]


def config_for(case: Case, ids: torch.Tensor, training: bool) -> dm.MoEConfig:
    """The case's layer, its receive bound chosen from the received rows of its first call
    (``ids``, per ``case.bound``)."""
    K, TK = case.top_k, case.max_tokens * case.top_k
    most = max(received_rows(ids, case))
    factor = {
        "roomy": float(case.ep * K),
        "exact": (max(most, 1) - 0.5) / TK,  # ceil(factor * T_max * K) = most
        "minus_one": (max(most - 1, 1) - 0.5) / TK,
        "tight": case.tight_factor,
    }[case.bound]
    return dm.MoEConfig(hidden=case.hidden, ffn=case.ffn, num_experts=case.num_experts,
                        top_k=K, max_tokens=case.max_tokens, training=training,
                        row_block=case.row_block, device_scratch_factor=factor,
                        activation_factor=case.activation_factor,
                        **(SAVING[case.saving] if training else {}))


@dataclass(frozen=True)
class Expected:
    """What the routing rule makes of a case (independent of ``distmoe.routing``).

    Attributes:
        executed: bool [N, K]: the route runs.
        recv: routes received per rank (executed or not).
        dropped: received routes beyond the bound, per rank.
        invalid: ids outside [-1, E) in the whole call (every rank counts them all).
        bound: R_b.
    """

    executed: torch.Tensor
    recv: list[int]
    dropped: list[int]
    invalid: int
    bound: int


def expected_routes(ids: torch.Tensor, case: Case, bound: int) -> Expected:
    """Rank r takes the valid routes to its experts in (global expert, source rank, t, k)
    order, i.e. by (id, flat route index), and executes the first ``bound`` of them."""
    v = ids.long().reshape(-1)
    valid = is_valid(v, case.num_experts)
    executed = torch.zeros_like(valid)
    recv, dropped = [], []
    for r in range(case.ep):
        mine = (valid & (v // case.experts_per_rank == r)).nonzero().squeeze(1)
        order = mine[torch.sort(v[mine], stable=True).indices]  # stable: flat index order
        executed[order[:bound]] = True
        recv.append(int(mine.numel()))
        dropped.append(max(0, int(mine.numel()) - bound))
    invalid = int(((v != -1) & ~valid).sum())
    return Expected(executed.view(ids.shape), recv, dropped, invalid, bound)


def executed_only(ids: torch.Tensor, scores: torch.Tensor, executed: torch.Tensor):
    """The same call with every route that does not run disabled (int64 ids, -1; score 0)."""
    return (torch.where(executed, ids.long(), -1),
            torch.where(executed, scores, torch.zeros((), dtype=scores.dtype)))


def upstream(case: Case) -> torch.Tensor:
    """The gradient of y, [N, D] fp32 with bf16-exact values."""
    g = torch.Generator().manual_seed(case.seed + 777)
    return torch.randn(case.ep * case.tokens, case.hidden, generator=g).bfloat16().float()


# ---------------------------------------------------------------------------- rank side
def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as an integer tensor (NaN payloads and -0 compared exactly)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def guarded(t: torch.Tensor, before: int = GUARD, after: int = GUARD):
    """A copy of t inside a larger buffer whose ``before`` / ``after`` elements are guard
    bytes: (buffer, the contiguous view passed to the layer)."""
    flat = torch.empty(before + t.numel() + after, dtype=t.dtype, device=t.device)
    flat.view(torch.uint8).fill_(GUARD_BYTE)
    view = flat[before:before + t.numel()].view(t.shape)
    view.copy_(t)
    return flat, view


def guard_damage(name: str, flat: torch.Tensor, view: torch.Tensor) -> list[str]:
    """Guard bytes around ``view`` inside ``flat`` that changed."""
    start = (view.data_ptr() - flat.data_ptr()) // flat.element_size()
    size = flat.element_size()
    raw = flat.view(torch.uint8)
    head, tail = raw[:start * size], raw[(start + view.numel()) * size:]
    bad = int((head != GUARD_BYTE).sum()) + int((tail != GUARD_BYTE).sum())
    return [f"{name}: {bad} guard bytes written"] if bad else []


def _poison(t: torch.Tensor) -> None:
    t.view(torch.int16).fill_(POISON)


def _poisoned_rows(t: torch.Tensor) -> torch.Tensor:
    """bool [rows]: the row still holds only the poison."""
    return (t.view(torch.int16) == POISON).all(1).cpu()


def poison_context(ctx) -> None:
    """This rank's peer buffers and scratch rows filled with poison: a row the call should
    not write keeps it, a row read before it is written turns y into NaN. Safe between
    calls: the peers write them only after the next call's first barrier."""
    _poison(ctx._combine)
    _poison(ctx._dispatch)
    if not ctx.cfg.training:
        _poison(ctx._h2)
    if ctx.ep_size > 1:
        _poison(ctx._pulled)


def poison_damage(ctx, case: Case, exp: Expected, rank: int, x: torch.Tensor) -> list[str]:
    """After one inference call on poisoned buffers (:func:`poison_context`), the rows
    written where nothing should have been, and the rows not written that should have:
    combine rows exactly at this rank's executed routes ``t*K + k``, dispatch rows
    ``0..T-1`` holding x (none where EP = 1 reads x in place), h2 rows exactly the rows
    this rank executes (activation rows are compact: padding rows are never stored)."""
    T, K = case.tokens, case.top_k
    out = []
    combine = _poisoned_rows(ctx._combine)
    want = torch.ones_like(combine)
    want[:T * K] = ~exp.executed[rank * T:(rank + 1) * T].reshape(-1)
    if not torch.equal(combine, want):
        wrong = (combine != want).nonzero().squeeze(1).tolist()
        out.append(f"combine rows {wrong[:8]} (of {len(wrong)}) written against the routing")
    dispatch = _poisoned_rows(ctx._dispatch)
    in_place = ctx.ep_size == 1 and x.data_ptr() % 16 == 0
    if not bool(dispatch[T:].all()):
        out.append(f"dispatch rows beyond T = {T} written")
    if in_place and not bool(dispatch[:T].all()):
        out.append("dispatch rows written although EP = 1 reads x in place")
    if not in_place and not same_bits(ctx._dispatch[:T], x):
        out.append("dispatch rows 0..T-1 do not hold x")
    h2 = _poisoned_rows(ctx._h2)
    rows = exp.recv[rank] - exp.dropped[rank]
    want_h2 = torch.ones_like(h2)
    want_h2[:rows] = False
    if not torch.equal(h2, want_h2):
        wrong = (h2 != want_h2).nonzero().squeeze(1).tolist()
        out.append(f"h2 rows {wrong[:8]} (of {len(wrong)}) written against {rows} executed")
    return out


def _rank_device(device: str) -> torch.device:
    """The rank's device: the CPU, or the CUDA device ``dm.launch`` made current for it."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _rank_problem(case: Case, rank: int):
    """(global ids, this rank's inputs as a tuple x, expert_ids, scores, w13, w2)."""
    problem = make_problem(case)
    mine = split_global_problem(*problem, case.ep)[rank]
    return problem[1], (mine.x, mine.expert_ids, mine.scores, mine.w13, mine.w2)


def _must_rerun(case: Case, ids: torch.Tensor, exp: Expected) -> bool:
    """Whether some route with an id other than -1 does not run, or an inactive route
    carries a stray score: then the call is repeated with those routes disabled."""
    inactive = ids.long() == -1
    stray = case.stray_score != 0 and bool(inactive.any())
    return stray or bool((exp.executed != ~inactive).any())


def _guarded_args(inputs, dev, x_offset: int):
    """Every input inside a guarded buffer: (views passed to the layer, checks to run)."""
    names = ("x", "expert_ids", "scores", "w13", "w2")
    views, kept = [], []
    for name, t in zip(names, inputs, strict=True):
        t = t.to(dev)
        flat, view = guarded(t, x_offset if name == "x" else GUARD)
        views.append(view)
        kept.append((name, flat, view, t.clone()))
    return views, kept


def _input_damage(kept) -> list[str]:
    out = []
    for name, flat, view, original in kept:
        out += guard_damage(name, flat, view)
        if not same_bits(view, original):
            out.append(f"{name} was modified by the call")
    return out


def _counters(before: dict, after: dict) -> dict:
    delta = {k: after[k] - before[k] for k in COUNTERS}
    delta["last_recv_rows"] = after["last_recv_rows"]
    return delta


def _overrides(case: Case) -> dict | None:
    if case.pull_all is None or case.ep == 1:
        return None
    return {"layer": {"pull_all": case.pull_all}}


def _forward_call(ctx, rank: int, call: Case, dev: torch.device) -> dict:
    """One call on poisoned buffers and guarded inputs, then, where some route does not
    run, the same call with those routes disabled."""
    ids_all, inputs = _rank_problem(call, rank)
    exp = expected_routes(ids_all, call, ctx.receive_bound)
    T, D = call.tokens, call.hidden
    args, kept = _guarded_args(inputs, dev, call.x_offset)
    poison_context(ctx)
    before = ctx.stats()
    if call.via_out:
        poisoned = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
        _poison(poisoned)
        flat_y, y = guarded(poisoned)
        ctx.forward_layer(*args, out=y)
    else:
        y = ctx(*args)
    after = ctx.stats()
    failures = poison_damage(ctx, call, exp, rank, args[0]) + _input_damage(kept)
    if call.via_out:
        failures += guard_damage("out", flat_y, y)
    if bool((bits(y) == POISON).any()):
        failures.append("elements of y not written")
    rerun_same = None
    if _must_rerun(call, ids_all, exp):
        mine = exp.executed[rank * T:(rank + 1) * T].to(dev)
        ids2, scores2 = executed_only(args[1], args[2], mine)
        y2 = ctx(args[0], ids2, scores2, args[3], args[4])
        rerun_same = same_bits(y, y2)
        again = _counters(after, ctx.stats())
        if again["dropped_rows"] or again["invalid_ids"]:
            failures.append(f"the call with only executed routes counted {again}")
    return dict(y=y.cpu(), counters=_counters(before, after), failures=failures,
                rerun_same=rerun_same)


def _forward_case(rank: int, case: Case, dev: torch.device) -> list[dict]:
    """The case's calls on one inference context (its bound from the first call)."""
    cfg = config_for(case, make_problem(case)[1], training=False)
    with dm.MoEContext(cfg, device=dev, overrides=_overrides(case)) as ctx:
        return [_forward_call(ctx, rank, call, dev) for call in case.calls()]


def forward_fuzz_rank(rank: int, world: int, cases: list[Case], device: str = "cpu"):
    """Every case in one launch (a context per case: its receive bound is the case's)."""
    dev = _rank_device(device)
    return [_forward_case(rank, case, dev) for case in cases]


def _leaves(views):
    """x, scores, w13, w2 of ``views`` made differentiable (in place: they stay guarded)."""
    x, ids, scores, w13, w2 = views
    for t in (x, scores, w13, w2):
        t.requires_grad_(True)
    return x, ids, scores, w13, w2


def _train_step(ctx, args, gy) -> list[torch.Tensor]:
    """One forward and backward: [y, grad x, grad scores, grad w13, grad w2] on the CPU."""
    x, ids, scores, w13, w2 = args
    y = ctx(x, ids, scores, w13, w2)
    (y.float() * gy).sum().backward()
    return [y.detach().cpu()] + [t.grad.cpu() for t in (x, scores, w13, w2)]


def _training_call(ctx, rank: int, call: Case, dev: torch.device) -> dict:
    """One forward and backward on poisoned buffers and guarded inputs, then, where some
    route does not run, the same step with those routes disabled."""
    ids_all, inputs = _rank_problem(call, rank)
    exp = expected_routes(ids_all, call, ctx.receive_bound)
    T = call.tokens
    gy = upstream(call)[rank * T:(rank + 1) * T].to(dev)
    views, kept = _guarded_args(inputs, dev, call.x_offset)
    args = _leaves(views)
    poison_context(ctx)
    before = ctx.stats()
    out = _train_step(ctx, args, gy)
    after = ctx.stats()
    failures = _input_damage(kept)
    rerun_same = None
    if _must_rerun(call, ids_all, exp):
        x, ids, scores, w13, w2 = (t.detach().clone() for t in views)
        mine = exp.executed[rank * T:(rank + 1) * T].to(dev)
        ids2, scores2 = executed_only(ids, scores, mine)
        again = _train_step(ctx, _leaves([x, ids2, scores2, w13, w2]), gy)
        rerun_same = all(same_bits(a, b) for a, b in zip(out, again, strict=True))
    return dict(y=out[0], grads=out[1:], counters=_counters(before, after),
                failures=failures, rerun_same=rerun_same)


def _training_case(rank: int, case: Case, dev: torch.device) -> list[dict]:
    """The case's steps on one training context (its bound from the first call)."""
    cfg = config_for(case, make_problem(case)[1], training=True)
    with dm.MoEContext(cfg, device=dev, overrides=_overrides(case)) as ctx:
        return [_training_call(ctx, rank, call, dev) for call in case.calls()]


def training_fuzz_rank(rank: int, world: int, cases: list[Case], device: str = "cpu"):
    dev = _rank_device(device)
    return [_training_case(rank, case, dev) for case in cases]


def _determinism(rank: int, case: Case, dev: torch.device, repeats: int) -> dict:
    """Fixed inputs, ``repeats`` times each in one process: the inference forward (one
    context) and the training forward and backward (one context, fresh leaves each step).
    Returns every output (``forward``: [[y]] per call, ``training``: [[y, grad x, grad
    scores, grad w13, grad w2]] per step) and this rank's dropped rows per call."""
    ids_all, inputs = _rank_problem(case, rank)
    T = case.tokens
    gy = upstream(case)[rank * T:(rank + 1) * T].to(dev)
    out = {}
    with dm.MoEContext(config_for(case, ids_all, training=False), device=dev) as ctx:
        args = [t.to(dev) for t in inputs]
        out["forward"] = [[ctx(*args).cpu()] for _ in range(repeats)]
        out["dropped"] = ctx.stats()["dropped_rows"] // repeats
    with dm.MoEContext(config_for(case, ids_all, training=True), device=dev) as ctx:
        out["training"] = [_train_step(ctx, _leaves([t.to(dev).clone() for t in inputs]), gy)
                           for _ in range(repeats)]
    return out


def determinism_rank(rank: int, world: int, case: Case, device: str = "cpu",
                     repeats: int = 1) -> dict:
    """:func:`_determinism` in a launch of its own."""
    return _determinism(rank, case, _rank_device(device), repeats)


def suite_rank(rank: int, world: int, plan: dict, device: str = "cpu") -> dict:
    """Everything one launch runs (``fuzz_plan.fuzz_plan``): ``forward`` and ``training``
    results per case, and with a ``determinism`` case its outputs of two calls."""
    dev = _rank_device(device)
    out = dict(forward=[_forward_case(rank, c, dev) for c in plan["forward"]],
               training=[_training_case(rank, c, dev) for c in plan["training"]])
    if plan["determinism"] is not None:
        out["determinism"] = _determinism(rank, plan["determinism"], dev, repeats=2)
    return out


# ---------------------------------------------------------------------------- host side
@dataclass
class Tally:
    """Counts over the cases of one run."""

    cases: int = 0  # contexts
    calls: int = 0  # calls checked (follow-up calls included, reruns not)
    routes: int = 0
    rows_moved: int = 0  # executed routes: gathered by the experts, returned to the owners
    dropped: int = 0
    invalid: int = 0
    bound_hit_exactly: int = 0  # calls in which some rank received exactly R_b rows
    bound_exceeded: int = 0  # calls in which some rank received more than R_b rows
    reruns: int = 0  # calls repeated with the routes that do not run disabled (same bits)

    def add(self, call: Case, exp: Expected, rerun: bool) -> None:
        self.calls += 1
        self.routes += call.ep * call.tokens * call.top_k
        self.rows_moved += int(exp.executed.sum())
        self.dropped += sum(exp.dropped)
        self.invalid += exp.invalid
        self.bound_hit_exactly += any(r == exp.bound for r in exp.recv)
        self.bound_exceeded += any(r > exp.bound for r in exp.recv)
        self.reruns += rerun

    def line(self) -> str:
        return (f"{self.cases} cases, {self.calls} calls, {self.routes} routes, "
                f"{self.rows_moved} rows moved, {self.dropped} dropped, {self.invalid} "
                f"invalid ids, bound hit exactly in {self.bound_hit_exactly} calls, exceeded "
                f"in {self.bound_exceeded}, {self.reruns} reruns with only executed routes")


def _reference_inputs(call: Case, bound: int):
    """The call's global problem, what the routing makes of it under ``bound``, and the
    reference's inputs: ids with every route that does not run disabled, fp32 scores
    (what the layer sums) zero there."""
    x, ids, scores, w13, w2 = make_problem(call)
    exp = expected_routes(ids, call, bound)
    ids_ref, scores_ref = executed_only(ids, scores.float(), exp.executed)
    return exp, (x, ids_ref, scores_ref, w13, w2)


def _calls_with_bound(case: Case):
    """(call, its receive bound) for every call of the case (the bound of the first)."""
    bound = config_for(case, make_problem(case)[1], training=False).receive_bound(case.ep)
    return [(call, bound) for call in case.calls()]


def rule_error(ours, ref64, ref16, floor: float) -> str | None:
    """The tolerance rule of tests/ops (forward_cases.check_against_reference and
    test_training._check): our max abs error against the fp64 oracle is at most 2x that of
    the bf16 PyTorch reference (which rounds h1, h2, h3 to bf16 like the kernels) plus
    ``floor``; None when it holds, else the figures."""
    if ours.numel() == 0:
        return None
    err = (ours.double() - ref64).abs().max().item()
    ref_err = (ref16.double() - ref64).abs().max().item()
    if err <= 2 * ref_err + floor:  # False for NaN
        return None
    return f"error {err:.3g} vs bf16 reference {ref_err:.3g} (floor {floor:.3g})"


def _counter_problems(exp: Expected, rank: int, got: dict) -> list[str]:
    want = dict(dropped_rows=exp.dropped[rank], invalid_ids=exp.invalid, calls=1,
                token_count_mismatches=0, last_recv_rows=exp.recv[rank])
    return [f"rank {rank} stats {k} = {got[k]}, expected {v}" for k, v in want.items()
            if got[k] != v]


def _rank_problems(exp: Expected, results: list[dict]) -> list[str]:
    out = []
    for rank, res in enumerate(results):
        out += _counter_problems(exp, rank, res["counters"])
        out += [f"rank {rank}: {f}" for f in res["failures"]]
        if res["rerun_same"] is False:
            out.append(f"rank {rank}: y (or a gradient) differs from the call with only "
                       "the executed routes")
    return out


def _label(case: Case, i: int) -> str:
    return case.short() + (f" call {i}" if case.then_tokens is not None else "")


def check_forward(cases: list[Case], per_rank: list[list[list[dict]]]):
    """Every call's y against the reference on the executed routes, its counters against
    :func:`expected_routes`, and the rank-side findings: ``(Tally, problems)``."""
    tally, problems = Tally(), []
    for i, case in enumerate(cases):
        tally.cases += 1
        for j, (call, bound) in enumerate(_calls_with_bound(case)):
            results = [r[i][j] for r in per_rank]
            exp, (x, ids, scores, w13, w2) = _reference_inputs(call, bound)
            tally.add(call, exp, results[0]["rerun_same"] is not None)
            found = _rank_problems(exp, results)
            y = torch.cat([r["y"] for r in results])
            y64 = moe_reference(x.double(), ids, scores.double(), w13.double(), w2.double())
            y16 = moe_reference(x, ids, scores, w13, w2)
            err = rule_error(y, y64, y16, 1e-2)
            if err:
                found.append(f"y: {err}")
            idle = ~exp.executed.any(1)  # tokens none of whose routes run: exact zeros
            if not torch.equal(y[idle].float(), torch.zeros_like(y[idle].float())):
                found.append("tokens without an executed route are not zero")
            problems += [f"{_label(case, j)}: {f}" for f in found]
    return tally, problems


def _ref_grads(inputs, gy):
    """torch autograd of moe_reference(*inputs) with upstream gy: (y, grads of x, scores,
    w13, w2)."""
    leaves = [t.clone().requires_grad_(True) if t.is_floating_point() else t for t in inputs]
    y = moe_reference(*leaves)
    if y.requires_grad:  # not when no route runs (moe_reference returns zeros)
        (y.to(gy.dtype) * gy).sum().backward()
    return y.detach(), [torch.zeros_like(t) if t.grad is None else t.grad
                        for t in leaves if t.is_floating_point()]


def check_training(cases: list[Case], per_rank: list[list[list[dict]]]):
    """y and the gradients of x, scores, w13 and w2 against torch autograd of the reference
    on the executed routes (the rule of tests/ops/test_training.py: a floor of 1/128 of the
    largest fp64 gradient), zero score gradients where a route does not run, counters and
    rank-side findings as in :func:`check_forward`: ``(Tally, problems)``."""
    tally, problems = Tally(), []
    names = ("y", "grad x", "grad scores", "grad w13", "grad w2")
    for i, case in enumerate(cases):
        tally.cases += 1
        for j, (call, bound) in enumerate(_calls_with_bound(case)):
            results = [r[i][j] for r in per_rank]
            exp, (x, ids, scores, w13, w2) = _reference_inputs(call, bound)
            tally.add(call, exp, results[0]["rerun_same"] is not None)
            found = _rank_problems(exp, results)
            gy = upstream(call)
            y64, g64 = _ref_grads([x.double(), ids, scores.double(), w13.double(),
                                   w2.double()], gy.double())
            y16, g16 = _ref_grads([x, ids, scores, w13, w2], gy)
            ours = [torch.cat([r["y"] for r in results])]
            for k in range(4):
                parts = [r["grads"][k] for r in results]
                ours.append(merge_expert_tensors(parts) if k >= 2 else torch.cat(parts))
            for name, o, r64, r16 in zip(names, ours, [y64] + g64, [y16] + g16, strict=True):
                err = rule_error(o, r64, r16, r64.abs().max().item() / 128 + 1e-6)
                if err:
                    found.append(f"{name}: {err}")
            if bool(ours[2][~exp.executed].ne(0).any()):
                found.append("score gradients of routes that do not run are not zero")
            problems += [f"{_label(case, j)}: {f}" for f in found]
    return tally, problems
