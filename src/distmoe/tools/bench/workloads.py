"""Benchmark workloads: named layer shapes, a routing generator with an imbalance knob, inputs.

Shape legend: ``_T`` tokens, ``_K`` routes per token, ``_D`` hidden, ``_F`` expert width,
``_e`` (local) experts, ``_E`` global experts.

Routing imbalance (specification seed 002, section 07, adapted to one GPU): the experts are cut
into ``num_groups`` equal groups, group 0 standing for the experts rank 0 owns at
EP = ``num_groups``. Balanced routing sends R/num_groups = T*K/num_groups routes to each group;
an imbalance factor f sends ``round(f * T*K / num_groups)`` routes to group 0 (the *tracked*
group) and spreads the rest evenly over the other experts. Inside a group the rows are spread
evenly (counts differ by at most one), so the histogram is exact, not sampled. With
``num_groups = EP`` this is the seed's definition (rank 0 receives f times its balanced rows when
every source rank routes this way); at EP = 1 it skews the expert histogram the single GPU's
grouped GEMM sees.

Feasibility: a token picks an expert at most once, so no expert can hold more than T routes;
f <= num_groups (group 0 cannot take more than all routes) and the tracked experts' share
f*T*K/E_group must be <= T. Infeasible requests raise ``ValueError``.

Sampled routing (``--routing sampled``): each token draws K distinct experts uniformly at
random, so the histogram is balanced in expectation only, as a real router's is; per-expert row
counts then end in partial kernel steps, which the exact histogram (multiples of T*K/E) can
hide. It takes no imbalance knob.

Construction of ids without duplicate experts per token: list the experts (in a seeded random
order) each repeated by its count, a sequence of T*K entries; entry p goes to token p % T, slot
p // T. An expert's run is at most T long, so it covers distinct tokens. Token order and the
slot order inside each token are then shuffled. Everything is seeded and runs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmoe.reference import random_routing

# ----------------------------------------------------------------------------- named shapes


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """One routed-expert layer: D, F, E, K and a default token count per rank."""

    name: str
    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    tokens: int
    description: str


# Tokens per rank for the model shapes (their sources do not fix one).
DEFAULT_MODEL_TOKENS = 4096

#: Shape names of older runs (results files, logs, scripts) and the names of the same layers
#: now: ``issue-a`` and ``issue-b`` were named for the issue that set them, ``fine`` was
#: ``qwen3-30b-a3b`` under a second name.
LEGACY_SHAPE_NAMES: dict[str, str] = {
    "issue-a": "dense-e32",
    "issue-b": "qwen3-30b-a3b-t2048",
    "fine": "qwen3-30b-a3b",
}


class _Shapes(dict):
    """The named shapes; an old name (:data:`LEGACY_SHAPE_NAMES`) looked up by ``[]`` gives
    the shape of its new name (for old scripts and results), but is not listed."""

    def __missing__(self, name: str) -> MoEShape:
        if name in LEGACY_SHAPE_NAMES:
            return self[LEGACY_SHAPE_NAMES[name]]
        raise KeyError(name)


SHAPES: dict[str, MoEShape] = _Shapes({
    s.name: s
    for s in (
        MoEShape(
            name="deepseek-v3",
            hidden=7168,
            ffn=2048,
            num_experts=256,
            top_k=8,
            tokens=DEFAULT_MODEL_TOKENS,
            description="DeepSeek-V3-like",
        ),
        MoEShape(
            name="qwen3-30b-a3b",
            hidden=2048,
            ffn=768,
            num_experts=128,
            top_k=8,
            tokens=DEFAULT_MODEL_TOKENS,
            description="Qwen3-30B-A3B-like",
        ),
        MoEShape(
            name="olmoe",
            hidden=2048,
            ffn=1024,
            num_experts=64,
            top_k=8,
            tokens=DEFAULT_MODEL_TOKENS,
            description="OLMoE-like",
        ),
        MoEShape(
            name="gpt-oss-120b",
            hidden=2880,
            ffn=2880,
            num_experts=128,
            top_k=4,
            tokens=DEFAULT_MODEL_TOKENS,
            description="GPT-OSS-120B-like",
        ),
        MoEShape(
            name="gpt-oss-20b",
            hidden=2880,
            ffn=2880,
            num_experts=32,
            top_k=4,
            tokens=DEFAULT_MODEL_TOKENS,
            description="GPT-OSS-20B-like",
        ),
        MoEShape(
            name="deepseek-v4-flash",
            hidden=4096,
            ffn=2048,
            num_experts=256,
            top_k=6,
            tokens=DEFAULT_MODEL_TOKENS,
            description="DeepSeek-V4-Flash-like",
        ),
        MoEShape(
            name="dense-e32",
            hidden=4096,
            ffn=2048,
            num_experts=32,
            top_k=8,
            tokens=8192,
            description="few wide experts (E=32), many tokens",
        ),
        MoEShape(
            name="qwen3-30b-a3b-t2048",
            hidden=2048,
            ffn=768,
            num_experts=128,
            top_k=8,
            tokens=2048,
            description="Qwen3-30B-A3B-like at 2048 tokens per rank",
        ),
        MoEShape(
            name="smoke",
            hidden=64,
            ffn=32,
            num_experts=8,
            top_k=2,
            tokens=64,
            description="tiny shape for CPU smoke runs of the harness",
        ),
    )
})


# Shapes of the default suite (sized to finish in about six minutes on one H200).
DEFAULT_SHAPES: tuple[str, ...] = (
    "dense-e32", "qwen3-30b-a3b-t2048", "qwen3-30b-a3b", "deepseek-v3")
# Shapes of --full: every named GPU shape.
FULL_SHAPES: tuple[str, ...] = tuple(n for n in SHAPES if n != "smoke")


def current_shape_name(name: str) -> str:
    """``name`` as the bench names that layer now (an old name mapped, others unchanged)."""
    return LEGACY_SHAPE_NAMES.get(name, name)


def get_shape(name: str) -> MoEShape:
    """The named shape (an old name, :data:`LEGACY_SHAPE_NAMES`, gives its layer's shape);
    ValueError for an unknown name."""
    name = current_shape_name(name)
    if name not in SHAPES:
        raise ValueError(f"shape ({name!r}) must be one of {sorted(SHAPES)}")
    return SHAPES[name]


# ----------------------------------------------------------------------------- routing


def _even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers differing by at most one (larger ones first)."""
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def imbalanced_expert_counts(
    *, tokens: int, top_k: int, num_experts: int, imbalance: float = 1.0, num_groups: int = 1
) -> list[int]:
    """Routes per global expert: group 0 gets ``round(imbalance * T*K / num_groups)`` routes.

    Returns ``num_experts`` counts summing to ``tokens * top_k``, each at most ``tokens``.
    """
    t, k, e, g = tokens, top_k, num_experts, num_groups
    if min(t, k, e, g) < 1:
        raise ValueError(f"tokens, top_k, num_experts, num_groups must be >= 1, got {t, k, e, g}")
    if k > e:
        raise ValueError(f"top_k ({k}) must be <= num_experts ({e})")
    if e % g:
        raise ValueError(f"num_experts ({e}) must be divisible by num_groups ({g})")
    if not imbalance >= 1.0:
        raise ValueError(f"imbalance ({imbalance}) must be >= 1")
    e_group = e // g
    num_routes = t * k
    tracked = round(imbalance * num_routes / g)
    rest = num_routes - tracked
    if g == 1:
        if tracked != num_routes:
            raise ValueError(f"imbalance ({imbalance}) needs num_groups > 1")
        return _even_split(num_routes, e)
    if rest < 0:
        raise ValueError(
            f"imbalance ({imbalance}) must be <= num_groups ({g}): group 0 cannot take more "
            "than all routes"
        )
    counts = _even_split(tracked, e_group) + _even_split(rest, e - e_group)
    if max(counts) > t:
        raise ValueError(
            f"imbalance ({imbalance}) infeasible for T={t} K={k} E={e} num_groups={g}: an expert "
            f"would need {max(counts)} routes but a token picks an expert at most once "
            f"(max {t}); the largest feasible factor is {g * e_group / k:g}"
        )
    return counts


def routing_from_counts(
    counts: list[int], *, tokens: int, top_k: int, seed: int = 0
) -> torch.Tensor:
    """Expert ids ``[T, K]`` int64 with exactly ``counts[e]`` routes to expert e, no duplicates.

    See the module docstring for the construction. Requires ``sum(counts) == T*K`` and
    ``max(counts) <= T``.
    """
    if sum(counts) != tokens * top_k:
        raise ValueError(f"sum(counts) ({sum(counts)}) must equal tokens*top_k ({tokens * top_k})")
    if counts and max(counts) > tokens:
        raise ValueError(f"max(counts) ({max(counts)}) must be <= tokens ({tokens})")
    gen = torch.Generator().manual_seed(seed)
    counts_e = torch.tensor(counts, dtype=torch.int64)
    order_e = torch.randperm(len(counts), generator=gen)
    sequence = torch.repeat_interleave(order_e, counts_e[order_e])  # [T*K], expert runs
    # Entry p -> token p % T, slot p // T: column-major fill of [K, T], transposed.
    ids_TK = sequence.view(top_k, tokens).t()
    ids_TK = ids_TK[torch.randperm(tokens, generator=gen)]
    slot_perm_TK = torch.argsort(torch.rand(tokens, top_k, generator=gen), dim=1)
    return torch.gather(ids_TK, 1, slot_perm_TK).contiguous()


def make_scores(tokens: int, top_k: int, *, seed: int = 0) -> torch.Tensor:
    """Router weights ``[T, K]`` fp32: softmax of seeded normal logits (rows sum to 1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)


@dataclass(frozen=True, kw_only=True)
class Routing:
    """A generated routing.

    Attributes:
        expert_ids_TK: ``[T, K]`` int64 global expert ids (CPU), no duplicates per token.
        scores_TK: ``[T, K]`` fp32 router weights (CPU).
        rows_per_expert_E: routes per global expert.
        num_groups: expert groups used for the imbalance (group 0 is tracked).
        imbalance: requested factor.
        achieved_imbalance: tracked-group routes / (T*K / num_groups).
    """

    expert_ids_TK: torch.Tensor
    scores_TK: torch.Tensor
    rows_per_expert_E: tuple[int, ...]
    num_groups: int
    imbalance: float
    achieved_imbalance: float

    @property
    def tracked_rows(self) -> int:
        e_group = len(self.rows_per_expert_E) // self.num_groups
        return sum(self.rows_per_expert_E[:e_group])


ROUTING_KINDS = ("exact", "sampled")


def sampled_expert_ids(*, tokens: int, top_k: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    """Expert ids ``[T, K]`` int64: each token draws ``K`` distinct experts uniformly at random
    (seeded, CPU). The histogram is sampled, so expert loads vary around T*K/E as with a real
    router at balance (and most experts' row counts are not multiples of a kernel's step)."""
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
    gen = torch.Generator().manual_seed(seed)
    return random_routing(tokens, num_experts, top_k, generator=gen)[0]


def make_routing(
    *,
    tokens: int,
    top_k: int,
    num_experts: int,
    imbalance: float = 1.0,
    num_groups: int = 1,
    seed: int = 0,
    kind: str = "exact",
) -> Routing:
    """Seeded routing. ``kind="exact"``: the expert histogram is exact (see the module
    docstring), with the imbalance knob; ``"sampled"``: :func:`sampled_expert_ids`, balanced
    in expectation only (``imbalance`` must be 1)."""
    if kind not in ROUTING_KINDS:
        raise ValueError(f"routing kind ({kind!r}) must be one of {ROUTING_KINDS}")
    if kind == "sampled":
        if imbalance != 1.0:
            raise ValueError(
                f"imbalance ({imbalance}) needs routing kind 'exact': sampled routing is "
                "balanced in expectation only"
            )
        ids = sampled_expert_ids(tokens=tokens, top_k=top_k, num_experts=num_experts, seed=seed)
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()
    else:
        counts = imbalanced_expert_counts(
            tokens=tokens,
            top_k=top_k,
            num_experts=num_experts,
            imbalance=imbalance,
            num_groups=num_groups,
        )
        ids = routing_from_counts(counts, tokens=tokens, top_k=top_k, seed=seed)
    e_group = num_experts // num_groups
    achieved = sum(counts[:e_group]) / (tokens * top_k / num_groups)
    return Routing(
        expert_ids_TK=ids,
        scores_TK=make_scores(tokens, top_k, seed=seed + 1),
        rows_per_expert_E=tuple(counts),
        num_groups=num_groups,
        imbalance=float(imbalance),
        achieved_imbalance=achieved,
    )


# ----------------------------------------------------------------------------- layer inputs


@dataclass(kw_only=True)
class LayerInputs:
    """Tensors of one benchmark case on one rank (all on the benchmark device).

    Attributes:
        x_TD: ``[T, D]`` bf16 tokens (requires grad in training).
        expert_ids_TK: ``[T, K]`` int64 global ids.
        scores_TK: ``[T, K]`` fp32 (requires grad in training).
        w13_e2FD: ``[E_local, 2, F, D]`` bf16, ``[gate; up]``.
        w2_eDF: ``[E_local, D, F]`` bf16.
        grad_y_TD: ``[T, D]`` bf16 output gradient used in training iterations.
        routing: the generator's record.
    """

    x_TD: torch.Tensor
    expert_ids_TK: torch.Tensor
    scores_TK: torch.Tensor
    w13_e2FD: torch.Tensor
    w2_eDF: torch.Tensor
    grad_y_TD: torch.Tensor
    routing: Routing


def make_weights(
    shape: MoEShape,
    *,
    num_local_experts: int,
    device: torch.device | str,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded ``w13 [E_local, 2, F, D]`` (std 1/sqrt(D)) and ``w2 [E_local, D, F]`` (1/sqrt(F))."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, d, f = num_local_experts, shape.hidden, shape.ffn
    w13 = torch.randn(e, 2, f, d, generator=gen, device=device, dtype=dtype) * d**-0.5
    w2 = torch.randn(e, d, f, generator=gen, device=device, dtype=dtype) * f**-0.5
    return w13, w2


def make_layer_inputs(
    shape: MoEShape,
    *,
    tokens: int,
    ep_size: int = 1,
    rank: int = 0,
    imbalance: float = 1.0,
    num_groups: int = 1,
    training: bool = False,
    device: torch.device | str = "cpu",
    seed: int = 0,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    routing_kind: str = "exact",
) -> LayerInputs:
    """Inputs of rank ``rank``: its own tokens and routing (``routing_kind``, see
    :func:`make_routing`), its local expert shard of weights.

    ``weights`` (w13, w2) are reused when given (they do not depend on the routing), otherwise
    generated. In training, ``x``, ``scores`` and the weights require grad.
    """
    if shape.num_experts % ep_size:
        raise ValueError(
            f"num_experts ({shape.num_experts}) must be divisible by ep_size ({ep_size})"
        )
    rank_seed = seed + 1000 * rank
    routing = make_routing(
        tokens=tokens,
        top_k=shape.top_k,
        num_experts=shape.num_experts,
        imbalance=imbalance,
        num_groups=num_groups,
        seed=rank_seed,
        kind=routing_kind,
    )
    gen = torch.Generator(device=device).manual_seed(rank_seed + 7)
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    grad_y = torch.randn(tokens, shape.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    if weights is None:
        weights = make_weights(
            shape,
            num_local_experts=shape.num_experts // ep_size,
            device=device,
            seed=rank_seed + 11,
        )
    w13, w2 = weights
    scores = routing.scores_TK.to(device)
    if training:
        x.requires_grad_(True)
        scores.requires_grad_(True)
        w13.requires_grad_(True)
        w2.requires_grad_(True)
    return LayerInputs(
        x_TD=x,
        expert_ids_TK=routing.expert_ids_TK.to(device),
        scores_TK=scores,
        w13_e2FD=w13,
        w2_eDF=w2,
        grad_y_TD=grad_y,
        routing=routing,
    )
