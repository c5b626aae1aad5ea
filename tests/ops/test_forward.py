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
    rule = dm.MoEContext.w13_phases_rule
    assert rule(8192, 8, 32)  # 2048 rows: T=8192, E=32, K=8
    assert not rule(4096, 8, 128)  # 256 rows: the fine-grained shape (measured even)
    assert rule(4096, 8, 32) and not rule(4095, 8, 32)


def _beside_rule_rank(rank, world):
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=4, top_k=2, max_tokens=16,
                       training=False)
    with dm.MoEContext(cfg, device="cpu") as ctx:
        chosen = ctx._w2_runs_beside(False)
        reasons = [ctx._w2_beside_reason(False), ctx._w2_beside_reason(True)]
        ctx._w2_beside = True
        try:
            ctx._w2_runs_beside(False)
        except ValueError as exc:
            forced = str(exc)
        else:
            forced = None
        ctx._w2_beside = False
        fused = [ctx._runs_fused(False), ctx._fused_reason(False), ctx._fused_reason(True)]
        ctx._fused = True
        try:
            ctx._runs_fused(False)
        except ValueError as exc:
            fused.append(str(exc))
        ctx._w2_beside = True
        try:
            ctx._runs_fused(False)
        except ValueError as exc:
            fused.append(str(exc))
    return chosen, reasons, forced, fused


def test_w2_beside_w13_is_refused_without_a_gpu_per_rank():
    """W2 runs beside W13, or both fused into one kernel, only when asked for and where
    every rank has a GPU of its own (GPU runs: the multigpu tests); on CPU ranks forcing it
    says why."""
    for chosen, (infer, train), forced, fused in dm.launch(_beside_rule_rank, 2):
        assert chosen is False
        assert "'cpu' heap" in infer and "every rank on a GPU of its own" in infer
        assert "inference only" in train
        assert forced is not None and forced.startswith("W2 beside W13 cannot run here")
        # the fused W13 + W2 kernel: the same rule, off by default, one way at a time
        f_chosen, f_infer, f_train, f_forced, f_both = fused
        assert f_chosen is False and f_infer == infer and f_train == train
        assert f_forced.startswith("the fused W13 + W2 kernel cannot run here")
        assert "set one of _fused and _w2_beside" in f_both
    ((chosen, (infer, _), _, fused),) = dm.launch(_beside_rule_rank, 1)
    assert chosen is False and "EP > 1" in infer and "EP > 1" in fused[1]


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
        return dm.MoEContext.pull_all_rule(ep, k, tokens, max_tokens)

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
