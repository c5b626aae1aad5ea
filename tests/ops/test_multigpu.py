"""One rank per GPU on every visible GPU (2, 4 or 8 H200s; skipped with fewer than two):
the heap, the forward on every routing case, training (saving and replaying), a CUDA-graph
training step, the forward with x in the context's input buffer, and with W2 beside W13 and
with W13 and W2 fused (eager and in a graph). These are issue 8's correctness runs; on one
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


def _w2_beside_rank(rank, world):
    """W2 beside W13 (it can run here: inference, a GPU per rank, Gluon GEMMs at 1024 rows
    per local expert; off by default) against W2 after W13, bit for bit, eager for every
    routing case and with the 2-program W2 (long waits); then one CUDA graph captured
    beside, replayed with each case's inputs copied in, against the eager result."""
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, args_of = _beside_problem(rank, world, dev)
    outs = []
    with dm.MoEContext(cfg, device=dev, check=True) as ctx:
        default = (ctx._w2_runs_beside(False), ctx._w2_beside_reason(False))
        eager = {}
        for name, args in args_of.items():
            ctx._w2_beside = False
            after = ctx(*args)
            ctx._w2_beside = True
            beside = ctx(*args)
            ctx._w2_beside_programs = 2
            narrow = ctx(*args)
            ctx._w2_beside_programs = None
            torch.cuda.synchronize()
            eager[name] = beside.clone()
            outs.append((name, torch.equal(after, beside), torch.equal(after, narrow),
                         bool(torch.isfinite(after.float()).all())))
        replays = _graph_replays(ctx, args_of, eager)
    return default, outs, replays


def _fused_rank(rank, world):
    """W13 and W2 as one fused kernel (off by default; it can run here) against the two
    kernels in sequence with the same tiles, bit for bit, for every routing case: the
    cooperative tiles (W2 at 128 x 256 in the sequence too) and the ping-pong tiles (W13
    128 x 64, W2 128 x 128), each with its tiles handed out at run time and statically, at
    lags 1 to 3; then one CUDA graph of the fused layer (ping-pong, lag 3, run-time hand-out)
    replayed with each case's inputs against its eager result."""
    from distmoe.kernels.w2_forward.config import W2Config
    from distmoe.kernels.w13_forward.config import W13Config

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, args_of = _beside_problem(rank, world, dev)
    tiles = {  # the fused kernel's tiles as the two kernels' configs
        False: (W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                          group_m=8, persistent=True, gluon=True),
                W2Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                         group_m=8, persistent=True, gluon=True)),
        True: (W13Config(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=6,
                         group_m=8, persistent=True, gluon=True),
               W2Config(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                        group_m=8, persistent=True, gluon=True))}
    outs = []
    with dm.MoEContext(cfg, device=dev, check=True) as ctx:
        default = (ctx._runs_fused(False), ctx._fused_reason(False))
        eager = {}
        for name, args in args_of.items():
            for pingpong, lag, dynamic in ((False, 2, True), (False, 1, False),
                                           (True, 3, True), (True, 2, False)):
                ctx._w13_cfg, ctx._w2_cfg = tiles[pingpong]
                ctx._fused = False
                after = ctx(*args)
                ctx._fused, ctx._fused_pingpong = True, pingpong
                ctx._fused_lag, ctx._fused_dynamic = lag, dynamic
                fused = ctx(*args)
                torch.cuda.synchronize()
                if (pingpong, lag, dynamic) == (True, 3, True):
                    eager[name] = fused.clone()
                outs.append((f"{name} pp={pingpong} lag={lag} dynamic={dynamic}",
                             torch.equal(after, fused),
                             bool(torch.isfinite(after.float()).all())))
        ctx._fused, ctx._fused_pingpong, ctx._fused_lag = True, True, 3
        ctx._fused_dynamic = True
        replays = _graph_replays(ctx, args_of, eager)
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
def test_w2_beside_w13_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_w2_beside_rank, len(gpus), device="cuda", gpus=gpus, timeout=600)
    for default, outs, replays in out:
        assert default == (False, None), default  # off by default; it can run here
        for name, same, same_narrow, finite in outs:
            assert finite, name
            assert same, f"{name}: beside differs from in sequence"
            assert same_narrow, f"{name}: beside with 2 W2 programs differs"
        assert all(same for _, same in replays), replays


@pytest.mark.multigpu
def test_fused_w13_w2_one_rank_per_gpu():
    gpus = _gpus()
    out = dm.launch(_fused_rank, len(gpus), device="cuda", gpus=gpus, timeout=600)
    for default, outs, replays in out:
        assert default == (False, None), default  # off by default; it can run here
        for name, same, finite in outs:
            assert finite, name
            assert same, f"{name}: fused differs from the two kernels in sequence"
        assert all(same for _, same in replays), replays
