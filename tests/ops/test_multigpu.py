"""One rank per GPU on every visible GPU (2, 4 or 8 H200s; skipped with fewer than two):
the heap, the forward on every routing case, training (saving and replaying), a CUDA-graph
training step, the forward with x in the context's input buffer, and with W13 and W2 in one kernel
(Mega; eager and in a graph). These are issue 8's correctness runs; on one
GPU the same code runs with ranks sharing it (test_forward_gpu.py, test_training_gpu.py)."""

import pytest
import torch
from forward_cases import CASES, check_against_reference, forward_cases_rank, make_problem
from test_training import check_training
from test_training_gpu import _graph_step_rank

import distmoe as dm
from distmoe.reference import split_global_problem
from distmoe.runtime import create_heap
from distmoe.runtime.selftest import peer_put_check


def _gpus():
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _heap_rank(rank, world):
    heap = create_heap()
    try:
        return heap.backend, peer_put_check(heap)
    finally:
        heap.close()


@pytest.mark.multigpu
def test_heap_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_heap_rank, len(gpus), device="cuda", gpus=gpus, timeout=300)
    assert [o[1] for o in out] == [out[0][1]] * len(gpus)


@pytest.mark.multigpu
def test_forward_one_rank_per_gpu():
    gpus = _gpus()
    EP, T, D, F, E, K = len(gpus), 200, 256, 128, 8 * len(gpus), 4
    names = sorted(CASES)
    per_rank = dm.launch(forward_cases_rank, EP, device="cuda", gpus=gpus, timeout=600,
                         args=(91 + EP, T, D, F, E, K, names, "cuda"))
    for i, name in enumerate(names):
        check_against_reference([r[i] for r in per_rank], 91 + EP, EP, T, D, F, E, K, name)


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["save", "replay"])
def test_training_one_rank_per_gpu(mode):
    gpus = _gpus()
    check_training(len(gpus), mode, "cuda", gpus=gpus)


@pytest.mark.multigpu
def test_cuda_graph_training_step_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_graph_step_rank, len(gpus), device="cuda", gpus=gpus, timeout=600)
    for results, depth in out:
        assert depth == [0]
        for same, replayed_flags, eager_flags in results:
            assert same and replayed_flags == eager_flags


BESIDE = dict(T=1024, D=512, F=384, K=4)
BESIDE_CASES = ("balanced", "imbalance_8x", "all_to_one_expert", "inactive_mix")


def _beside_problem(rank, world, dev):
    """The inference config and each of BESIDE_CASES' per-rank inputs on ``dev``."""
    T, D, F, K = BESIDE["T"], BESIDE["D"], BESIDE["F"], BESIDE["K"]
    E = 4 * world
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, training=False,
                       device_scratch_factor=float(world))
    args_of = {}
    for i, name in enumerate(BESIDE_CASES):
        mine = split_global_problem(*make_problem(31 + i, world, T, D, F, E, K, name),
                                    world)[rank]
        args_of[name] = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores, mine.w13,
                                             mine.w2)]
    return cfg, args_of


def _graph_replays(ctx, args_of, eager, x_in_buffer=False):
    """One CUDA graph of ``ctx`` captured on the first case, replayed with each case's
    inputs copied in: ``[(case, replay == eager[case] bit for bit)]``. With
    ``x_in_buffer`` the graph's x is ``ctx.input_buffer(T)``, where each case's x is
    written."""
    ctx.check = False  # its host-side checks synchronise: not inside a capture
    static = [t.clone() for t in args_of[BESIDE_CASES[0]]]
    if x_in_buffer:
        static[0] = ctx.input_buffer(static[0].shape[0]).copy_(static[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ctx(*static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = ctx(*static)
    replays = []
    for name in reversed(BESIDE_CASES):
        for dst, src in zip(static, args_of[name], strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        replays.append((name, torch.equal(y_static, eager[name])))
    return replays


def _mega_rank(rank, world):
    """W13 and W2 as one persistent kernel (Mega; off by default, it can run here) against
    the two kernels in sequence with the same tiles, bit for bit, for every routing case: the
    cooperative tiles (W2 at 128 x 256 in the sequence too) and the ping-pong tiles (W13
    128 x 64, W2 128 x 128), each with its tiles handed out at run time and statically, at
    lags 1 to 3; then one CUDA graph of Mega (ping-pong, lag 3, run-time hand-out) replayed
    with each case's inputs against its eager result."""
    from distmoe.kernels.w2_forward.config import W2Config
    from distmoe.kernels.w13_forward.config import W13Config

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, args_of = _beside_problem(rank, world, dev)
    tiles = {  # Mega's tiles as the two kernels' configs
        False: (W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                          group_m=8, persistent=True, gluon=True),
                W2Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                         group_m=8, persistent=True, gluon=True)),
        True: (W13Config(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=6,
                         group_m=8, persistent=True, gluon=True),
               W2Config(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                        group_m=8, persistent=True, gluon=True))}
    with dm.MoEContext(cfg, device=dev) as ctx:
        default = (ctx.plan.mega_config, ctx._mega_reason(False))
    outs, eager, replays = [], {}, []
    for pingpong, lag, dynamic in ((False, 2, True), (False, 1, False), (True, 3, True),
                                   (True, 2, False)):
        w13_cfg, w2_cfg = tiles[pingpong]
        kernels = {"w13": w13_cfg, "w2": w2_cfg}
        mega = dict(kernels, layer={"mega": True, "mega_pingpong": pingpong,
                                    "mega_lag": lag, "mega_dynamic": dynamic})
        with dm.MoEContext(cfg, device=dev, check=True, overrides=kernels) as seq, \
                dm.MoEContext(cfg, device=dev, check=True, overrides=mega) as fused_ctx:
            for name, args in args_of.items():
                after = seq(*args)
                fused = fused_ctx(*args)
                torch.cuda.synchronize()
                if (pingpong, lag, dynamic) == (True, 3, True):
                    eager[name] = fused.clone()
                outs.append((f"{name} pp={pingpong} lag={lag} dynamic={dynamic}",
                             torch.equal(after, fused),
                             bool(torch.isfinite(after.float()).all())))
            if (pingpong, lag, dynamic) == (True, 3, True):
                replays = _graph_replays(fused_ctx, args_of, eager)
    return default, outs, replays


def _input_buffer_rank(rank, world):
    """x written into ``ctx.input_buffer(T)`` against x as a tensor of its own, eager on
    every case (the buffer NaN first: the forward must not read rows it did not get), and
    one CUDA graph captured with x in the buffer, replayed with each case's x written
    there, against the eager results."""
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, args_of = _beside_problem(rank, world, dev)
    outs, eager = [], {}
    with dm.MoEContext(cfg, device=dev, check=True) as ctx:
        for name, args in args_of.items():
            eager[name] = ctx(*args)
            ctx._dispatch.fill_(float("nan"))
            buf = ctx.input_buffer(args[0].shape[0]).copy_(args[0])
            y = ctx(buf, *args[1:])
            outs.append((name, torch.equal(eager[name], y),
                         bool(torch.isfinite(y.float()).all())))
        replays = _graph_replays(ctx, args_of, eager, x_in_buffer=True)
    return outs, replays


@pytest.mark.multigpu
def test_input_buffer_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_input_buffer_rank, len(gpus), device="cuda", gpus=gpus, timeout=600)
    for outs, replays in out:
        for name, same, finite in outs:
            assert finite and same, name
        assert all(same for _, same in replays), replays


@pytest.mark.multigpu
def test_mega_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_mega_rank, len(gpus), device="cuda", gpus=gpus, timeout=600)
    for default, outs, replays in out:
        assert default == (None, None), default  # off by default; it can run here
        for name, same, finite in outs:
            assert finite, name
            assert same, f"{name}: Mega differs from the two kernels in sequence"
        assert all(same for _, same in replays), replays
