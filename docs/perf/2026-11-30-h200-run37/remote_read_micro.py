"""Micro: how fast SMs read a peer's memory over NVLink (two H200s, both ranks at once).

Run 37's deferred returns had the owner's combine read 13.4 MB of rows from the peer's heap
beside its local reads, and those arrived at about 180 GB/s. Here 64 MiB of bf16 rows
(D=2048) sit in each rank's heap, and each rank reads its peer's copy into local memory:
by the copy engines (a pull), by SM loads of contiguous blocks (persistent grids), by SM
loads of 128 x 128 tiles of randomly permuted rows, and by one-row programs like the
owner combine's (one 1024-column half row per program, 8 warps, a grid over all rows).
Every result is checked bit for bit against the peer's rows.

    PYTHONPATH=src python3 -m torch.distributed.run --standalone --nproc-per-node=2 \\
        docs/perf/2026-11-30-h200-run37/remote_read_micro.py
"""
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, "src")
from distmoe.runtime import create_heap  # noqa: E402

D = 2048
BM, BN = 128, 128


@triton.jit
def _contig(src, dst, n_blocks, BLOCK: tl.constexpr):
    for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))


@triton.jit
def _tiles(src, dst, perm, n_tiles, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    NPN: tl.constexpr = D // BN
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        pm = t // NPN
        pn = t % NPN
        r = pm * BM + tl.arange(0, BM)
        c = pn * BN + tl.arange(0, BN)
        s = tl.load(perm + r).to(tl.int64)
        v = tl.load(src + s[:, None] * D + c[None, :])
        tl.store(dst + r[:, None].to(tl.int64) * D + c[None, :], v)


@triton.jit
def _row_halves(src, dst, perm, D: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.load(perm + r).to(tl.int64)
    tl.store(dst + r.to(tl.int64) * D + c, tl.load(src + s * D + c))


dist.init_process_group("gloo")
rank, ep = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
heap = create_heap(device=dev)
R = (32 << 20) // D  # rows: 64 MiB
heap.allocate("rx", R * D * 2)
mine = heap.view("rx", rank, torch.bfloat16, (R, D))
peer = 1 - rank
src = heap.view("rx", peer, torch.bfloat16, (R, D))
g = torch.Generator().manual_seed(rank)
mine.copy_(torch.randn(R, D, generator=g).to(torch.bfloat16))
perm = torch.randperm(R, generator=g).to(torch.int32).to(dev)
ident = torch.arange(R, dtype=torch.int32, device=dev)
out = torch.empty(R, D, dtype=torch.bfloat16, device=dev)
tiles = (R // BM) * (D // BN)
heap.barrier()
torch.cuda.synchronize()
dist.barrier()
variants = {
    "ce.pull": (lambda: out.copy_(src), None),
    "local.ce (one GPU)": (lambda: out.copy_(mine), "local"),
}
for n in (132, 264, 528, 1056):
    variants[f"sm{n}.contig"] = (
        lambda n=n: _contig[(n,)](src, out, R * D // 8192, BLOCK=8192, num_warps=8), None)
for n in (132, 528):
    variants[f"sm{n}.tiles.perm"] = (
        lambda n=n: _tiles[(n,)](src, out, perm, tiles, D=D, BM=BM, BN=BN, num_warps=8), "perm")
variants["rows.halves.perm (combine-like)"] = (
    lambda: _row_halves[(R, D // 1024)](src, out, perm, D=D, BLOCK_D=1024, num_warps=8), "perm")
variants["rows.halves.ident"] = (
    lambda: _row_halves[(R, D // 1024)](src, out, ident, D=D, BLOCK_D=1024, num_warps=8), None)
xs = [torch.empty(R, D, dtype=torch.bfloat16) for _ in range(ep)]
dist.all_gather(xs, mine.cpu())
for name_v, (fn, kind) in variants.items():
    out.fill_(float("nan"))
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        if rank == 0:
            print(f"{name_v:32s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        dist.barrier()
        continue
    dist.barrier()
    ts = []
    for _ in range(9):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        s.record()
        for _ in range(5):
            fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 5 * 1000)
    ts.sort()
    gbs = R * D * 2 / (ts[4] * 1e-6) / 1e9
    want = xs[rank] if kind == "local" else xs[peer]
    if kind == "perm":
        want = want[perm.cpu().long()]
    ok = torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
    if rank == 0:
        print(f"{name_v:32s} {ts[4]:8.1f} us  {gbs:6.1f} GB/s  (fastest {ts[0]:.1f}) "
              f"bits ok={ok}", flush=True)
    dist.barrier()
heap.close()
dist.destroy_process_group()
