"""Forward on one H200: EP=1 (symmetric memory) and EP=2/4 as ranks sharing the GPU (IPC
heap); CUDA-graph replay with new inputs equals eager; no host synchronisation."""

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
)

import distmoe as dm
from distmoe.plan import device_class, rules
from distmoe.reference import moe_reference, split_global_problem

D, F = 256, 128


@pytest.mark.gpu
@pytest.mark.parametrize("EP", [1, 2, 4])
def test_forward_gpu_matches_reference(EP):
    T, E, K = 200, 16, 4
    names = sorted(CASES)
    per_rank = dm.launch(forward_cases_rank, EP, device="cuda", gpus=[0], timeout=300,
                         args=(77 + EP, T, D, F, E, K, names, "cuda"))
    for i, name in enumerate(names):
        check_against_reference([r[i] for r in per_rank], 77 + EP, EP, T, D, F, E, K, name)


@pytest.mark.gpu
def test_forward_gpu_gluon_kernels_at_mid_rows_per_expert():
    """100 rows per expert (inference), where the heuristics take the Gluon W13 and W2 for
    experts whose weights total under 2 GiB since run 38: every routing case against the
    reference at EP=1."""

    T, E, K = 400, 16, 4
    dev = torch.device("cuda", 0)
    assert rules.w13_forward_config(hidden=D, ffn=F, rows_per_expert=T * K // E, device_class=device_class(dev),
                                    num_experts=E).gluon
    assert rules.w2_forward_config(hidden=D, ffn=F, rows_per_expert=T * K // E, device_class=device_class(dev),
                                   num_experts=E).gluon
    names = sorted(CASES)
    per_rank = dm.launch(forward_cases_rank, 1, device="cuda", gpus=[0], timeout=300,
                         args=(91, T, D, F, E, K, names, "cuda"))
    for i, name in enumerate(names):
        check_against_reference([r[i] for r in per_rank], 91, 1, T, D, F, E, K, name)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [128, 512])
def test_forward_gpu_expert_group_orders(rows):
    """128 and 512 rows per expert (inference, EP=1), where the heuristics walk the Gluon W2
    forward's tiles a group per expert (run 59), at 128 the cooperative W13's too, its
    producers in lockstep (runs 52, 58): every routing case against the reference."""

    E, K = 16, 4
    T = rows * E // K
    dev = torch.device("cuda", 0)
    keys = dict(hidden=D, ffn=F, rows_per_expert=rows, device=dev, num_experts=E)
    w13 = rules.w13_forward_config(**keys, training=False)
    assert (w13.gluon, w13.expert_groups) == (True, rows == 128), w13
    assert rules.w2_forward_config(**keys).expert_groups
    names = sorted(CASES)
    per_rank = dm.launch(forward_cases_rank, 1, device="cuda", gpus=[0], timeout=300,
                         args=(93, T, D, F, E, K, names, "cuda"))
    for i, name in enumerate(names):
        check_against_reference([r[i] for r in per_rank], 93, 1, T, D, F, E, K, name)


@pytest.mark.gpu
@pytest.mark.parametrize("EP", [1, 2, 4])
def test_input_buffer_gpu_with_ranks_sharing_the_gpu(EP):
    """x written into ``ctx.input_buffer(T)`` at EP = 1, 2 and 4 (the CPU test stops at
    EP = 2, and no machine with four GPUs has been lent): the same bits as x passed as its
    own tensor, for two inputs in the same buffer, no copy into the buffer, T below
    max_tokens; y against the reference."""
    T, E, K = 150, 16, 4
    per_rank = dm.launch(input_buffer_rank, EP, device="cuda", gpus=[0], timeout=300,
                         args=(51 + EP, T, D, F, E, K, "inactive_mix", 200, "cuda"))
    check_input_buffer_ranks(per_rank, 51 + EP, EP, T, D, F, E, K, "inactive_mix")


def _graph_rank(rank, world, T, E, K, phases=None, case="inactive_mix"):
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, training=False,
                       device_scratch_factor=float(world))
    problems = [split_global_problem(*make_problem(s, world, T, D, F, E, K, case),
                                     world)[rank] for s in (1, 2)]
    # phases: W13 in two launches around the copy-engine pull's join (or not)
    overrides = None if phases is None else {"layer": {"pull_all": phases,
                                                        "w13_phases": phases}}
    with dm.MoEContext(cfg, device=dev, overrides=overrides) as ctx:
        static = [t.to(dev) for t in (problems[0].x, problems[0].expert_ids,
                                      problems[0].scores, problems[0].w13, problems[0].w2)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ctx(*static)  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = ctx(*static)
        torch.cuda.synchronize()
        # no host synchronisation in the eager forward either
        torch.cuda.set_sync_debug_mode("error")
        try:
            ctx(*static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results = []
        for p in problems[::-1] + problems:
            new = [p.x, p.expert_ids, p.scores]
            for dst, src in zip(static[:3], new, strict=True):
                dst.copy_(src.to(dev))
            graph.replay()
            replayed = y_static.clone()
            eager = ctx(*static)
            torch.cuda.synchronize()
            results.append(bool(torch.equal(replayed, eager)))
        return results, y_static.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("EP", [1, 2])
def test_cuda_graph_replay_with_new_inputs_equals_eager(EP):
    out = dm.launch(_graph_rank, EP, device="cuda", gpus=[0], timeout=300, args=(64, 8, 2))
    _check_graph_ranks(out, EP, 64, 8, 2, "inactive_mix")


@pytest.mark.gpu
def test_cuda_graph_replay_with_w13_in_two_launches():
    # about 300 own rows per local expert: both launches have blocks, new routing per replay
    out = dm.launch(_graph_rank, 2, device="cuda", gpus=[0], timeout=300,
                    args=(600, 8, 4, True, "balanced"))
    _check_graph_ranks(out, 2, 600, 8, 4, "balanced")


@pytest.mark.gpu
def test_forward_gpu_w13_in_two_launches_gives_the_same_bits():
    T, E, K = 600, 8, 4
    outs = {}
    for phases in (True, False):
        outs[phases] = dm.launch(forward_rank, 2, device="cuda", gpus=[0], timeout=300, args=(
            31, T, D, F, E, K, "balanced", "cuda", 128, None, True, phases))
        check_against_reference(outs[phases], 31, 2, T, D, F, E, K, "balanced")
    for (y_two, s_two), (y_one, _) in zip(outs[True], outs[False], strict=True):
        assert s_two["w13_phased"] and 0 < s_two["w13_positions"][1] < s_two["w13_positions"][3]
        assert torch.equal(y_two.view(torch.int16), y_one.view(torch.int16))


def _check_graph_ranks(out, EP, T, E, K, case):
    for results, _ in out:
        assert all(results), results
    # the last replay ran problem 2's x, ids and scores with problem 1's weights
    x, ids, scores, _, _ = make_problem(2, EP, T, D, F, E, K, case)
    _, _, _, w13, w2 = make_problem(1, EP, T, D, F, E, K, case)
    y = torch.cat([o[1] for o in out]).double()
    y64 = moe_reference(x.double(), ids, scores.double(), w13.double(), w2.double())
    y16 = moe_reference(x, ids, scores, w13, w2).double()
    # bf16 rule of forward_cases.check_against_reference
    assert (y - y64).abs().max() <= 2 * (y16 - y64).abs().max() + 1e-2
