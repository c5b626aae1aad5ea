"""Distributed bf16 forward on CPU ranks (Triton interpreter) against the reference."""

import pytest
import torch
from forward_cases import (
    CASES,
    check_against_reference,
    check_input_buffer_ranks,
    forward_cases_rank,
    forward_rank,
    input_buffer_rank,
    make_problem,
    x_in_place_rank,
)

import distmoe as dm
from distmoe.plan import rules

D, F = 32, 32


@pytest.mark.parametrize("EP", [1, 2, 4])
def test_forward_matches_reference(EP):
    # T=20 is not a multiple of the 16-row block; E=8 experts, K=2; every routing case
    T, E, K = 20, 8, 2
    names = sorted(CASES)
    per_rank = dm.launch(forward_cases_rank, EP, args=(1234 + EP, T, D, F, E, K, names))
    for i, case_name in enumerate(names):
        out = [r[i] for r in per_rank]
        check_against_reference(out, 1234 + EP, EP, T, D, F, E, K, case_name)
        ids = make_problem(1234 + EP, EP, T, D, F, E, K, case_name)[1]
        E_local = E // EP
        for rank, (_, stats) in enumerate(out):
            mine = ((ids >= rank * E_local) & (ids < (rank + 1) * E_local)).sum().item()
            assert stats["last_recv_rows"] == mine and stats["dropped_rows"] == 0, case_name


@pytest.mark.parametrize("EP, T, E, K", [
    (3, 9, 6, 1),   # EP=3, K=1
    (2, 5, 4, 4),   # K equal to the number of experts
    (3, 7, 3, 3),   # one expert per rank, K=E, odd T smaller than the row block
])
def test_forward_edge_shapes(EP, T, E, K):
    out = dm.launch(forward_rank, EP, args=(99, T, D, F, E, K, "balanced"))
    check_against_reference(out, 99, EP, T, D, F, E, K, "balanced")


def test_physical_t_below_max_tokens():
    # buffers sized for 32 tokens, calls with 11
    out = dm.launch(forward_rank, 2, args=(5, 11, D, F, 4, 2, "inactive_mix", "cpu", 16, 32))
    check_against_reference(out, 5, 2, 11, D, F, 4, 2, "inactive_mix")


@pytest.mark.parametrize("EP, K", [(2, 2), (4, 3)])
def test_token_pull_both_ways(EP, K):
    """At EP > 1 the peer tokens reach W13 either all at once (while the tables are built)
    or as the tables name them: both match the reference and each other bit for bit, with
    fewer tokens than the buffers hold (the copy-all moves every row, used or not)."""
    T, E = 11, 8
    outs = {}
    for pull_all in (True, False):
        outs[pull_all] = dm.launch(forward_rank, EP, args=(
            17 + EP, T, D, F, E, K, "inactive_mix", "cpu", 16, 24, pull_all))
        check_against_reference(outs[pull_all], 17 + EP, EP, T, D, F, E, K, "inactive_mix")
    for (y_all, _), (y_named, _) in zip(outs[True], outs[False], strict=True):
        assert torch.equal(y_all.view(torch.int16), y_named.view(torch.int16))


def test_w13_in_two_launches_gives_the_same_bits():
    """With every peer token copied, W13 can run the row blocks of own tokens first, then
    the rest (distmoe.kernels.w13_forward.phases). Both ways match the reference and each other bit
    for bit."""
    EP, T, E, K = 2, 300, 4, 2  # about 150 own rows per local expert: whole own blocks
    outs = {}
    for phases in (True, False):
        outs[phases] = dm.launch(forward_rank, EP, args=(
            29, T, D, F, E, K, "balanced", "cpu", 128, None, True, phases))
        check_against_reference(outs[phases], 29, EP, T, D, F, E, K, "balanced")
    assert [s["w13_phased"] for _, s in outs[True]] == [True, True]
    for _, s in outs[True]:
        lo1, hi1, lo2, hi2 = s["w13_positions"]
        assert lo1 == 0 and 0 < hi1 == lo2 < hi2  # both launches had blocks
    assert [s["w13_phased"] for _, s in outs[False]] == [False, False]
    for (y_two, _), (y_one, _) in zip(outs[True], outs[False], strict=True):
        assert torch.equal(y_two.view(torch.int16), y_one.view(torch.int16))


def test_w13_phases_rule():
    """Two launches by default from 1024 rows per local expert from one rank (T_max*K/E)."""
    def rule(max_tokens, top_k, num_experts):
        return rules.w13_phases(max_tokens=max_tokens, top_k=top_k, num_experts=num_experts)

    assert rule(8192, 8, 32)  # 2048 rows: T=8192, E=32, K=8
    assert not rule(4096, 8, 128)  # 256 rows: the Qwen3-30B-A3B layer (measured even)
    assert rule(4096, 8, 32) and not rule(4095, 8, 32)


def _mega_rule_rank(rank, world):
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=2, max_tokens=16,
                       training=False)
    out = []
    with dm.MoEContext(cfg, device="cpu") as ctx:
        out.append((ctx.plan.mega_config, ctx._runs_mega(False)))
    try:
        with dm.MoEContext(cfg, device="cpu", overrides={"layer": {"mega": True}}) as ctx:
            out.append(ctx._mega_reason(False))
            x = torch.randn(16, D).bfloat16()
            ids = torch.zeros(16, 2, dtype=torch.int64)
            ids[:, 1] = 1
            ctx(x, ids, torch.rand(16, 2), torch.randn(4 // world, 2, F, D).bfloat16(),
                torch.randn(4 // world, D, F).bfloat16())
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_mega_is_refused_without_a_gpu_per_rank():
    """W13 and W2 in one kernel (Mega) only when the plan asks for it and where every rank
    has a GPU of its own (GPU runs: the multigpu tests); on CPU ranks the call says why, at
    EP=1 the plan itself refuses it."""
    for (default, ran), reason, raised in dm.launch(_mega_rule_rank, 2):
        assert default is None and ran is False
        assert "'cpu' heap" in reason and "every rank on a GPU of its own" in reason
        assert raised.startswith("Mega (W13 and W2 in one kernel) cannot run here")
    ((_, _), raised), = dm.launch(_mega_rule_rank, 1)
    assert "Mega runs in EP > 1 inference only" in raised


def _pipeline_rank(rank, world):
    out = {}
    for pipeline in ("auto", "staged", "mega"):
        cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=2, max_tokens=16,
                           training=False, pipeline=pipeline)
        try:
            with dm.MoEContext(cfg, device="cpu") as ctx:
                out[pipeline] = ctx.plan.mega_config
        except ValueError as exc:
            out[pipeline] = str(exc)
    return out


def test_pipeline_option():
    """``MoEConfig(pipeline=...)``: "auto" and "staged" plan no Mega (the rule,
    distmoe.plan.rules.pipeline_for); "mega" is refused when the context is built where it
    cannot run (CPU ranks share no GPU), at EP=1 by the plan, and in training or low
    precision by the config."""
    for out in dm.launch(_pipeline_rank, 2):
        assert out["auto"] is None and out["staged"] is None
        assert out["mega"].startswith("pipeline 'mega' (W13 and W2 in one kernel) cannot run "
                                      "here: the 'cpu' heap"), out["mega"]
    (out,) = dm.launch(_pipeline_rank, 1)
    assert out["mega"].startswith("pipeline 'mega' needs EP > 1"), out["mega"]
    with pytest.raises(ValueError, match=r"pipeline 'mega' runs bf16 inference only so far"):
        dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=2, max_tokens=16, pipeline="mega")
    with pytest.raises(ValueError, match=r"pipeline \('fused'\) must be one of"):
        dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=2, max_tokens=16,
                     training=False, pipeline="fused")


def test_ep1_reads_x_in_place_and_copies_a_misaligned_x():
    T, E, K = 13, 8, 3
    (y, y_odd, written, stats), = dm.launch(x_in_place_rank, 1,
                                            args=(23, T, D, F, E, K, "inactive_mix"))
    check_against_reference([(y, None)], 23, 1, T, D, F, E, K, "inactive_mix")
    assert torch.equal(y.view(torch.int16), y_odd.view(torch.int16))
    assert written == [False, True], written
    # EP = 1 keeps only the rewritten pointer table (no pull buffer, no flags)
    assert stats["pull_buffer_bytes"] == stats["row_capacity"] * 8 > 0


def test_pull_all_is_the_default_where_nearly_every_peer_token_is_needed():
    """The layer's choice: every peer token when T / T_max * (1 - (1 - 1/EP)^K) >= 0.9."""
    def choose(ep, k, tokens=64, max_tokens=64):
        return rules.pull_all(ep_size=ep, top_k=k, tokens=tokens, max_tokens=max_tokens)

    assert choose(2, 8) and choose(2, 4) and choose(3, 6)
    assert not choose(1, 8) and not choose(2, 2) and not choose(4, 8) and not choose(8, 8)
    # fewer tokens than the buffers: the copy of every T_max row would be mostly unused
    assert choose(2, 8, 59, 64) and not choose(2, 8, 57, 64) and not choose(2, 8, 8, 4096)
    assert not choose(2, 8, 0, 0)


@pytest.mark.parametrize("EP", [1, 2])
def test_x_written_into_the_input_buffer_skips_the_copy(EP):
    """x in ``ctx.input_buffer(T)``: the same bits as x passed as a tensor of its own, for
    the first input and for new rows written into the same buffer, with T below max_tokens
    and the rest of the buffer NaN; no copy writes the buffer then, while at EP > 1 the
    plain call copies x there."""
    T, E, K = 13, 8, 3
    per_rank = dm.launch(input_buffer_rank, EP, args=(41, T, D, F, E, K, "inactive_mix", 24))
    check_input_buffer_ranks(per_rank, 41, EP, T, D, F, E, K, "inactive_mix")


def _input_buffer_errors_rank(rank, world):
    out = []
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=2, max_tokens=8,
                       training=False, row_block=16)
    with dm.MoEContext(cfg, device="cpu") as ctx:
        for bad in (0, 9, True, 2.0):
            try:
                ctx.input_buffer(bad)
            except (TypeError, ValueError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        assert ctx.input_buffer().shape == (8, D)
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 4, (7, 2), generator=g)
        scores = torch.rand(7, 2, generator=g)
        w13 = torch.randn(4 // world, 2, F, D, generator=g).bfloat16()
        w2 = torch.randn(4 // world, D, F, generator=g).bfloat16()
        ctx._dispatch.fill_(3.0)
        shifted = ctx._dispatch[1:8]  # overlaps the buffer, one row in
        try:
            ctx(shifted, ids, scores, w13, w2)
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
        out.append(bool((ctx._dispatch.float() == 3.0).all()))  # nothing was written
    train = dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=2, max_tokens=8)
    with dm.MoEContext(train, device="cpu") as ctx:
        try:
            ctx.input_buffer()
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
    return out


def test_input_buffer_refusals():
    for out in dm.launch(_input_buffer_errors_rank, 2):
        zero, nine, flag, real, shifted, untouched, training = out
        assert zero.startswith("ValueError: tokens must be in [1, max_tokens = 8], got 0")
        assert nine.endswith("got 9")
        assert flag == "TypeError: tokens must be an int, got bool"
        assert real == "TypeError: tokens must be an int, got float"
        assert "x overlaps this context's input buffer" in shifted
        assert "pass ctx.input_buffer(T) itself" in shifted
        assert untouched is True
        assert "inference contexts (cfg.training=False)" in training
