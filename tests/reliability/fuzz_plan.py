"""What each launch of the reliability tests runs, drawn on the host with hypothesis (the
ranks never import this module).

Per EP size and device, :func:`fuzz_plan` lists the forward cases (the edge cases, then
drawn ones), the training cases (EP 1 and 2) and the determinism case (EP 1 and 2); one
launch runs them all (``fuzz_cases.suite_rank``, from tests/reliability/conftest.py).

``DISTMOE_FUZZ_EXAMPLES``: drawn forward cases per EP size (default :data:`DRAWN`: 8 at
EP 1 and 2, 3 at EP 3 and 4 on CPU ranks, 40 on a GPU); the training tests draw a third
of it (default 2 on CPU ranks, 13 on a GPU). ``DISTMOE_FUZZ_SEED`` (default 0) draws other
cases. A larger run: ``DISTMOE_FUZZ_EXAMPLES=200 DISTMOE_FUZZ_SEED=1 pytest -n 0
tests/reliability``.
"""

from __future__ import annotations

import math
import os

import hypothesis
from fuzz_cases import GUARD, IDS_DTYPES, SAVING, SCORE_DTYPES, SHAPES, Case
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

#: drawn forward cases per EP size on CPU ranks (the directory runs in 90 s on two cores)
DRAWN = {1: 8, 2: 8, 3: 3, 4: 3}
#: drawn forward cases per EP size on a GPU
DRAWN_GPU = 40


@st.composite
def case_strategy(draw, ep: int, device: str = "cpu", training: bool = False) -> Case:
    """A case at ``ep`` ranks: shapes, dtypes, routing skew, disabled / repeated / invalid
    routes, stray scores, the receive bound, x's alignment, y returned or written to
    ``out``; in training the slot budget."""
    hidden, ffn, t_cap = SHAPES[device]
    if training:
        t_cap = max(1, t_cap // 2)
    e_local = draw(st.integers(1, 4))
    E = ep * e_local
    # K up to E_local, and one above where E allows (a token then reaches two ranks at least)
    top_k = draw(st.integers(1, min(E, e_local + 1, 4)))
    # small shapes (where hypothesis starts) and shapes near the cap, where more rows move
    max_tokens = draw(st.one_of(st.integers(1, t_cap), st.integers(t_cap // 2, t_cap)))
    lo = 1 if training else 0  # T = 0 only without autograd
    tokens = draw(st.one_of(st.just(max_tokens), st.integers(lo, max_tokens)))
    frac = st.sampled_from((0.0, 0.25, 0.5, 0.9, 1.0))
    return Case(
        seed=draw(st.integers(0, 2**31 - 1)), ep=ep, experts_per_rank=e_local, top_k=top_k,
        max_tokens=max_tokens, tokens=tokens, row_block=draw(st.sampled_from((16, 32, 128))),
        ids_dtype=draw(st.sampled_from(IDS_DTYPES)),
        scores_dtype=draw(st.sampled_from(SCORE_DTYPES)),
        expert_skew=draw(frac), rank_skew=draw(frac),
        inactive=draw(st.sampled_from((0.0, 0.0, 0.25, 1.0))),
        repeats=draw(st.sampled_from((0.0, 0.0, 0.3))),
        invalid=draw(st.sampled_from((0.0, 0.0, 0.2))),
        stray_score=draw(st.sampled_from((0.0, 2.5, math.nan))),
        bound=draw(st.sampled_from(("roomy", "exact", "minus_one", "tight"))),
        tight_factor=draw(st.sampled_from((0.05, 0.25, 0.5))),
        x_offset=draw(st.sampled_from((GUARD, GUARD + 1))),
        via_out=False if training else draw(st.booleans()),
        activation_factor=draw(st.sampled_from((0.0, 1.0))) if training else 1.0,
        saving=draw(st.sampled_from(sorted(SAVING))) if training else "default",
        # a second call on the same context: new tokens, routing and T (stale state)
        then_tokens=draw(st.one_of(st.none(), st.integers(lo, max_tokens))),
        pull_all=draw(st.sampled_from((None, True, False))) if ep > 1 else None,
        hidden=hidden, ffn=ffn)


def draw_cases(strategy, n: int, seed: int) -> list[Case]:
    """``n`` examples of ``strategy`` drawn by hypothesis from ``seed`` (the same list every
    run), for one launch of ranks to run. Hypothesis cannot shrink a failure found in the
    ranks: the failing case's repr is the reproduction (``fuzz_cases.forward_fuzz_rank``)."""
    out: list[Case] = []

    @hypothesis.seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
    return out


def edge_cases(ep: int, device: str = "cpu", training: bool = False) -> list[Case]:
    """The listed edge cases at ``ep`` ranks, one line each, run before the drawn ones."""
    hidden, ffn, t_cap = SHAPES[device]
    t = (12 if training else 16) if device == "cpu" else t_cap // 2
    common = dict(ep=ep, hidden=hidden, ffn=ffn)
    cases = [
        # every token on one expert, K = E_local, T = T_max, bound exceeded by one row; then
        # fewer tokens on the same context
        Case(seed=11, experts_per_rank=2, top_k=2, max_tokens=t, tokens=t, expert_skew=1.0,
             ids_dtype="int16", scores_dtype="bfloat16", bound="minus_one",
             then_tokens=t // 2, **common),
        # every route inactive (int8 ids, float16 scores, NaN stray scores)
        Case(seed=12, experts_per_rank=2, top_k=2, max_tokens=t, tokens=t - 3, inactive=1.0,
             ids_dtype="int8", scores_dtype="float16", stray_score=math.nan, **common),
        # uint8 ids, repeated ids, every token preferring one rank, the bound hit exactly,
        # x not 16-byte aligned
        Case(seed=13, experts_per_rank=3, top_k=3, max_tokens=t, tokens=t, rank_skew=1.0,
             repeats=0.3, ids_dtype="uint8", scores_dtype="float64", bound="exact",
             x_offset=GUARD + 1, **common),
        # int32 ids, half of them invalid (some wrap to valid int16 ids), a tight bound
        Case(seed=14, experts_per_rank=1, top_k=1, max_tokens=t, tokens=t, invalid=0.5,
             ids_dtype="int32", stray_score=2.5, expert_skew=0.5, bound="tight",
             tight_factor=0.25, **common),
    ]
    if training:
        return cases
    # zero tokens (int64 ids), the output written through out= into a poisoned tensor; then
    # T = T_max on the same context
    cases.insert(0, Case(seed=10, experts_per_rank=2, top_k=2, max_tokens=t, tokens=0,
                         bound="exact", via_out=True, then_tokens=t, **common))
    return cases


def determinism_case(ep: int, device: str = "cpu") -> Case:
    """Fixed inputs of the determinism test: skew, disabled routes, a receive bound that
    some routes exceed."""
    big = device != "cpu"
    hidden, ffn, _ = SHAPES[device]
    return Case(seed=64, ep=ep, experts_per_rank=4 // ep, top_k=3,
                max_tokens=256 if big else 16, tokens=240 if big else 15, ids_dtype="int32",
                expert_skew=0.5, inactive=0.25, bound="tight", tight_factor=0.6,
                hidden=hidden, ffn=ffn)


def fuzz_examples(default: int) -> int:
    """Drawn forward cases per EP size: ``default``, or ``DISTMOE_FUZZ_EXAMPLES`` when set."""
    value = os.environ.get("DISTMOE_FUZZ_EXAMPLES", "")
    return int(value) if value.strip() else default


def fuzz_seed() -> int:
    """Added to hypothesis' seeds: 0, or ``DISTMOE_FUZZ_SEED`` when set (other cases)."""
    value = os.environ.get("DISTMOE_FUZZ_SEED", "")
    return int(value) if value.strip() else 0


def fuzz_plan(ep: int, device: str = "cpu") -> dict:
    """Everything one launch of ``ep`` ranks runs: ``forward`` and ``training`` case lists,
    the ``determinism`` case (None above EP 2)."""
    n = fuzz_examples(DRAWN[ep] if device == "cpu" else DRAWN_GPU)
    plan = dict(forward=edge_cases(ep, device)
                + draw_cases(case_strategy(ep, device), n, seed=640 + ep + fuzz_seed()),
                training=[], determinism=None)
    if ep <= 2:
        plan["training"] = (edge_cases(ep, device, training=True)
                            + draw_cases(case_strategy(ep, device, training=True),
                                         max(1, n // 3), seed=650 + ep + fuzz_seed()))
        plan["determinism"] = determinism_case(ep, device)
    return plan
