"""Plain-PyTorch reference of the routed-expert layer: the oracle of every test.

Shapes (one process, all experts; docs/design.md, "Notation and the math"):

    x            [T, D]        float (bf16, fp32 or fp64)
    expert_ids   [T, K]        any integer dtype; -1 disables a route
    scores       [T, K]        float; must be 0 on disabled routes
    w13          [E, 2, F, D]  gate = w13[e, 0], up = w13[e, 1]
    w2           [E, D, F]
    returns y    [T, D]        dtype of x

Per active route (t, k) with expert e: h1 = [x W_gate^T | x W_up^T], h2 = silu(g) * u,
h3 = h2 W2^T; y[t] = sum_k score[t, k] * h3[t, k], accumulated in fp32 (fp64 when the inputs
are fp64). The expert MLP runs in the inputs' dtype (so a bf16 reference rounds h1/h2/h3 to
bf16 like the kernels do). Everything is differentiable by autograd.

The split/merge helpers turn one global problem into the per-rank inputs of an EP group
(rank r owns global experts r*E_local .. (r+1)*E_local-1) and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def moe_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """Reference MoE layer over all experts on one process; see the module docstring."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, D], got shape {tuple(x.shape)}")
    T, D = x.shape
    if expert_ids.shape != scores.shape or expert_ids.dim() != 2 or expert_ids.shape[0] != T:
        raise ValueError(
            f"expert_ids {tuple(expert_ids.shape)} and scores {tuple(scores.shape)} must both be "
            f"[T, K] with T = {T}"
        )
    if w13.dim() != 4 or w13.shape[1] != 2 or w13.shape[3] != D:
        raise ValueError(f"w13 must be [E, 2, F, D] with D = {D}, got {tuple(w13.shape)}")
    E, _, Fw, _ = w13.shape
    if tuple(w2.shape) != (E, D, Fw):
        raise ValueError(f"w2 must be [E, D, F] = {(E, D, Fw)}, got {tuple(w2.shape)}")
    ids = expert_ids.long()
    if ((ids < -1) | (ids >= E)).any():
        raise ValueError(f"expert_ids must lie in [-1, {E}), got values outside")
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    K = ids.shape[1]
    y = x.new_zeros((T, D), dtype=acc_dtype)
    flat_ids = ids.reshape(-1)
    token_of_route = torch.arange(T * K, device=x.device) // K
    flat_scores = scores.reshape(-1)
    for e in range(E):
        routes = (flat_ids == e).nonzero().squeeze(1)
        if routes.numel() == 0:
            continue
        tokens = token_of_route[routes]
        xe = x[tokens]
        gate = xe @ w13[e, 0].t()
        up = xe @ w13[e, 1].t()
        h2 = F.silu(gate) * up
        h3 = h2 @ w2[e].t()
        weighted = h3.to(acc_dtype) * flat_scores[routes].to(acc_dtype).unsqueeze(1)
        y = y.index_add(0, tokens, weighted)
    return y.to(x.dtype)


@dataclass(frozen=True)
class RankInputs:
    """Inputs of one EP rank.

    Attributes:
        x: [T, D] this rank's tokens.
        expert_ids: [T, K] global expert ids (-1 inactive).
        scores: [T, K].
        w13: [E_local, 2, F, D] the rank's experts (global ids rank*E_local ...).
        w2: [E_local, D, F].
    """

    x: torch.Tensor
    expert_ids: torch.Tensor
    scores: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


def split_global_problem(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ep_size: int,
) -> list[RankInputs]:
    """Split a global problem (x [EP*T, D], ids/scores [EP*T, K], w13 [E, 2, F, D],
    w2 [E, D, F]) into ``ep_size`` per-rank inputs: rank r takes token rows r*T .. (r+1)*T-1
    and experts r*E_local .. (r+1)*E_local-1. Views are made contiguous clones."""
    if ep_size < 1 or x.shape[0] % ep_size:
        raise ValueError(f"x rows ({x.shape[0]}) must be divisible by ep_size ({ep_size})")
    E = w13.shape[0]
    if E % ep_size:
        raise ValueError(f"num_experts ({E}) must be divisible by ep_size ({ep_size})")
    T = x.shape[0] // ep_size
    E_local = E // ep_size
    out = []
    for r in range(ep_size):
        tok = slice(r * T, (r + 1) * T)
        exp = slice(r * E_local, (r + 1) * E_local)
        out.append(
            RankInputs(
                x=x[tok].contiguous().clone(),
                expert_ids=expert_ids[tok].contiguous().clone(),
                scores=scores[tok].contiguous().clone(),
                w13=w13[exp].contiguous().clone(),
                w2=w2[exp].contiguous().clone(),
            )
        )
    return out


def merge_rank_outputs(outputs: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-rank token outputs ([T, ...] each) back into the global order."""
    return torch.cat(list(outputs), dim=0)


def merge_expert_tensors(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-rank local-expert tensors ([E_local, ...] each, e.g. weight gradients)
    into the global expert order [E, ...]."""
    return torch.cat(list(per_rank), dim=0)


def random_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    generator: torch.Generator | None = None,
    inactive_fraction: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing: ids [T, K] int64 with distinct experts per token, softmax-like
    positive scores [T, K]; a fraction of routes is disabled (id -1, score 0)."""
    noise = torch.rand(num_tokens, num_experts, generator=generator)
    ids = noise.topk(top_k, dim=1).indices
    scores = torch.rand(num_tokens, top_k, generator=generator) + 0.1
    scores = scores / scores.sum(dim=1, keepdim=True)
    if inactive_fraction > 0:
        off = torch.rand(num_tokens, top_k, generator=generator) < inactive_fraction
        ids = ids.masked_fill(off, -1)
        scores = scores.masked_fill(off, 0.0)
    return ids, scores.to(dtype)
