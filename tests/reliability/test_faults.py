"""Faults (issue 64, item 2, CPU ranks): a hung rank turns into a RuntimeError on the rank
that waits for it, within the context's ``timeout``, naming the rank and the step; the
context is unusable afterwards (a clear error), and no shared-memory segment stays in
/dev/shm (the segments are unlinked as soon as every rank mapped them; the suite's conftest
checks /dev/shm after the session too).

A rank killed (SIGKILL) between a training forward and its backward: the survivor's backward
raises within the timeout naming it, the context is unusable, no segment stays (its own
processes: ``distmoe.launch`` stops the others as soon as it sees a death).

The GPU heaps (two ranks sharing one GPU, GPU only): a device barrier that waits past the
timeout ends on the GPU (no spin forever) and the rank's next call raises naming the rank
that did not arrive; the hung rank, back later, times out in turn. A rank killed (SIGKILL)
between a training forward and its backward: the survivor's backward ends on the GPU within
the timeout, its next call raises naming the dead rank, and once both processes are gone
the GPU holds none of their memory (NVML's process list).
"""

import os
import time

import pytest
import torch

import distmoe as dm

D, F, T, E, K = 32, 32, 8, 4, 2
TIMEOUT = 3.0


def _cfg(world, training):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=training, row_block=16, device_scratch_factor=float(world))


def _rank_inputs(rank, world, device="cpu", grad=False):
    """``(x, expert_ids, scores, w13, w2)`` of one rank (seeded by the rank) on ``device``;
    with ``grad`` every float input requires grad."""
    g = torch.Generator().manual_seed(rank)
    e_local = E // world
    out = [t.to(device) for t in (
        torch.randn(T, D, generator=g).bfloat16(),
        torch.rand(T, E, generator=g).topk(K, dim=1).indices,
        torch.rand(T, K, generator=g),
        (torch.randn(e_local, 2, F, D, generator=g) / D**0.5).bfloat16(),
        (torch.randn(e_local, D, F, generator=g) / F**0.5).bfloat16())]
    if grad:
        for i in (0, 2, 3, 4):
            out[i].requires_grad_(True)
    return tuple(out)


def _hang_rank(rank, world):
    args = _rank_inputs(rank, world)
    out = {}
    ctx = dm.MoEContext(_cfg(world, False), device="cpu", timeout=TIMEOUT)
    with torch.no_grad():
        ctx(*args)  # a healthy call first
        if rank == world - 1:
            time.sleep(4 * TIMEOUT)  # the hung rank: it comes back long after the others left
        start = time.monotonic()
        try:
            ctx(*args)
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = str(exc)
        out["seconds"] = time.monotonic() - start
        try:
            ctx(*args)
            out["after"] = None
        except RuntimeError as exc:
            out["after"] = str(exc)
    ctx.close()
    out["shm"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("distmoe"))
    return out


def test_hung_rank_becomes_an_error_naming_it():
    per_rank = dm.launch(_hang_rank, 2, timeout=120)
    waiting, hung = per_rank
    assert waiting["error"] is not None, "the waiting rank did not raise"
    assert "the barrier in _publish_and_route failed" in waiting["error"], waiting["error"]
    assert "1" in waiting["error"].split("(", 1)[1], waiting["error"]  # gloo names rank 1
    assert waiting["seconds"] < 4 * TIMEOUT, waiting["seconds"]
    assert waiting["after"].startswith("this MoEContext is unusable: rank 0 of 2"), \
        waiting["after"]
    # the hung rank, back after its peer left, waits in turn and raises too
    assert hung["error"] is not None and "failed" in hung["error"], hung["error"]
    assert hung["after"].startswith("this MoEContext is unusable"), hung["after"]
    for out in per_rank:
        assert not out["shm"], out["shm"]


# --------------------------------------------------------------------------------------------
# A killed rank (its own processes: distmoe.launch would stop the survivor at the death)
# --------------------------------------------------------------------------------------------


def _killed_rank_process(rank, world, store_path, results):
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    dist.barrier()
    x, ids, scores, w13, w2 = _rank_inputs(rank, world, grad=True)
    ctx = dm.MoEContext(_cfg(world, True), device="cpu", timeout=TIMEOUT)
    y = ctx(x, ids, scores, w13, w2)  # a healthy training forward; its backward is the fault
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # killed before the backward, holding nothing
    error, seconds, after = _backward_then_call(ctx, y, (x, ids, scores, w13, w2))
    ctx.close()
    results.put((error, seconds, after))


def _backward_then_call(ctx, y, args):
    """The survivor's side: ``y``'s backward (its error text or None, and seconds taken,
    the device synchronised on a GPU), then one more call of ``ctx`` (its error or None)."""
    start = time.monotonic()
    try:
        y.float().sum().backward()
        if y.is_cuda:
            torch.cuda.synchronize()  # returns: the GPU gave up waiting
        error = None
    except RuntimeError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    try:
        ctx(*(t.detach() for t in args))
        after = None
    except RuntimeError as exc:
        after = str(exc)
    return error, seconds, after


def test_killed_rank_becomes_an_error_on_the_survivor(tmp_path):
    import multiprocessing as mp

    before = set(_segments())
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    store = tmp_path / "store"
    procs = [spawn.Process(target=_killed_rank_process, args=(r, 2, str(store), results),
                           daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        error, seconds, after = results.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -9, procs[1].exitcode  # SIGKILL
    assert error is not None, "the survivor's backward did not raise"
    assert "failed" in error and "1" in error, error  # names the dead rank
    assert seconds < 4 * TIMEOUT, seconds
    assert after is not None and after.startswith("this MoEContext is unusable"), after
    left = sorted(set(_segments()) - before)
    assert not left, f"segments left in /dev/shm: {left}"
    print(f"survivor's error after {seconds:.1f} s: {error}")


def _segments():
    return [n for n in os.listdir("/dev/shm") if n.startswith("distmoe")]


# --------------------------------------------------------------------------------------------
# The GPU heaps: a device barrier that times out (ranks sharing one GPU)
# --------------------------------------------------------------------------------------------


def _gpu_hang_rank(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    args = _rank_inputs(rank, world, dev)
    out = {"errors": []}
    ctx = dm.MoEContext(_cfg(world, False), device=dev, graphs=False)  # the default timeout while compiling
    with torch.no_grad():
        ctx(*args)  # a healthy call first (every kernel compiled)
        torch.cuda.synchronize()
        ctx.heap.timeout = TIMEOUT
        if rank == world - 1:
            time.sleep(3 * TIMEOUT)  # hung: back long after its peer gave up
        start = time.monotonic()
        for _ in range(3):  # the waiting rank's barrier times out in the first of these
            try:
                ctx(*args)
                torch.cuda.synchronize()  # returns: the GPU does not spin forever
            except RuntimeError as exc:
                out["errors"].append(str(exc))
        out["seconds"] = time.monotonic() - start
    out["failed"] = ctx.heap.failed
    ctx.close()
    return out


@pytest.mark.gpu
def test_device_barrier_timeout_becomes_an_error():
    per_rank = dm.launch(_gpu_hang_rank, 2, device="cuda", gpus=[0], timeout=300)
    waiting, hung = per_rank
    # the waiting rank: its GPU gave up after TIMEOUT; its next calls raise, naming rank 1
    assert len(waiting["errors"]) == 2, waiting
    assert "waited" in waiting["errors"][0] and "for rank 1" in waiting["errors"][0], waiting
    assert waiting["errors"][1].startswith("this MoEContext is unusable"), waiting
    assert waiting["seconds"] < 3 * TIMEOUT, waiting["seconds"]
    # the hung rank, back later: its peer is gone, so one of its barriers times out in turn
    assert hung["errors"] and "for rank 0" in hung["failed"], hung


def _gpu_killed_rank_process(rank, world, store_path, results):
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    x, ids, scores, w13, w2 = _rank_inputs(rank, world, dev, grad=True)
    ctx = dm.MoEContext(_cfg(world, True), device=dev, graphs=False)  # default timeout while compiling
    ctx(x, ids, scores, w13, w2).float().sum().backward()  # every kernel compiled
    torch.cuda.synchronize()
    ctx.heap.timeout = TIMEOUT
    results.put(("pid", rank, os.getpid()))
    y = ctx(x, ids, scores, w13, w2)  # a healthy training forward; its backward is the fault
    torch.cuda.synchronize()
    dist.barrier()  # both forwards done
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # killed before the backward
    results.put(("done", *_backward_then_call(ctx, y, (x, ids, scores, w13, w2))))
    results.close()
    results.join_thread()  # flushed before leaving
    os._exit(0)  # the dead peer's IPC mappings: leave without a collective close


@pytest.mark.gpu
def test_killed_rank_on_a_gpu_heap_becomes_an_error(tmp_path):
    import multiprocessing as mp

    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    used_before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    procs = [spawn.Process(target=_gpu_killed_rank_process,
                           args=(r, 2, str(tmp_path / "store"), results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    pids, done, used_during = set(), None, 0
    try:
        while done is None:
            item = results.get(timeout=240)
            if item[0] == "pid":
                pids.add(item[2])
                used_during = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            else:
                done = item[1:]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    error, seconds, after = done
    assert procs[1].exitcode == -9, procs[1].exitcode  # SIGKILL
    # the survivor: its backward's device barrier gave up after TIMEOUT (no hang); at the
    # latest its next call raises, naming the rank that never arrived
    assert seconds < 4 * TIMEOUT, seconds
    text = error or after
    assert text is not None and "for rank 1" in text, (error, after)
    assert after is not None and "unusable" in after, after
    # both processes gone: none of their memory stays on the GPU (the device's used bytes
    # back to where they were; while they ran, their contexts held hundreds of MiB)
    try:
        for _ in range(40):
            used_after = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            if used_after <= used_before + (64 << 20):
                break
            time.sleep(0.5)
    finally:
        pynvml.nvmlShutdown()
    assert len(pids) == 2 and used_during > used_before + (256 << 20), (used_before,
                                                                        used_during)
    assert used_after <= used_before + (64 << 20), (used_before, used_after)
    print(f"survivor: backward {seconds:.1f} s, error {error!r}, next call {after!r}; GPU "
          f"memory used {used_before >> 20} MiB before, {used_during >> 20} during, "
          f"{used_after >> 20} after")
