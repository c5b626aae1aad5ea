"""Faults (issue 64, item 2, CPU ranks): a hung rank turns into a RuntimeError on the rank
that waits for it, within the context's ``timeout``, naming the rank and the step; the
context is unusable afterwards (a clear error), and no shared-memory segment stays in
/dev/shm (the segments are unlinked as soon as every rank mapped them; the suite's conftest
checks /dev/shm after the session too).

Not covered here: a rank that exits or is killed (``distmoe.launch`` stops the others as soon
as it sees a death, so their errors cannot be observed through it), and the GPU heaps, whose
device barriers take no timeout yet.
"""

import os
import time

import torch

import distmoe as dm

D, F, T, E, K = 32, 32, 8, 4, 2
TIMEOUT = 3.0


def _hang_rank(rank, world):
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       training=False, row_block=16, device_scratch_factor=float(world))
    g = torch.Generator().manual_seed(rank)
    e_local = E // world
    args = (torch.randn(T, D, generator=g).bfloat16(),
            torch.rand(T, E, generator=g).topk(K, dim=1).indices,
            torch.rand(T, K, generator=g),
            (torch.randn(e_local, 2, F, D, generator=g) / D**0.5).bfloat16(),
            (torch.randn(e_local, D, F, generator=g) / F**0.5).bfloat16())
    out = {}
    ctx = dm.MoEContext(cfg, device="cpu", timeout=TIMEOUT)
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
