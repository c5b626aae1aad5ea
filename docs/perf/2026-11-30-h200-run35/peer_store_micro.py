"""Micro: 64 MiB of bf16 rows (D=2048) stored into the peer's heap, both ranks at once, two
H200s. Copy engines, contiguous SM stores, the W2 epilogue's pattern (128-row x 128-column
tiles stored row by row to scattered destination rows), and TMA box stores of the same tiles
(contiguous destination rows). Every variant's result is checked bit for bit."""
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, "src")
from distmoe.runtime import create_heap  # noqa: E402

D = 2048
BM, BN = 128, 128


@triton.jit
def _contig(src, dst, n_blocks, BLOCK: tl.constexpr):
    for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs), cache_modifier=".cs")


@triton.jit
def _rows(src, dst, perm, n_tiles, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    NPN: tl.constexpr = D // BN
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        pm = t // NPN
        pn = t % NPN
        r = pm * BM + tl.arange(0, BM)
        c = pn * BN + tl.arange(0, BN)
        v = tl.load(src + r[:, None].to(tl.int64) * D + c[None, :])
        d = tl.load(perm + r).to(tl.int64)
        tl.store(dst + d[:, None] * D + c[None, :], v)


@triton.jit
def _tma(src, dst_desc, n_tiles, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    NPN: tl.constexpr = D // BN
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        pm = t // NPN
        pn = t % NPN
        r = pm * BM + tl.arange(0, BM)
        c = pn * BN + tl.arange(0, BN)
        v = tl.load(src + r[:, None].to(tl.int64) * D + c[None, :])
        dst_desc.store([pm * BM, pn * BN], v)


dist.init_process_group("gloo")
rank, ep = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
heap = create_heap(device=dev)
R = (32 << 20) // D  # rows: 64 MiB
heap.allocate("rx", R * D * 2)
mine = heap.view("rx", rank, torch.bfloat16, (R, D))
peer = 1 - rank
dst = heap.view("rx", peer, torch.bfloat16, (R, D))
g = torch.Generator().manual_seed(rank)
x = torch.randn(R, D, generator=g).to(torch.bfloat16).to(dev)
perm = torch.randperm(R, generator=g).to(torch.int32).to(dev)
ident = torch.arange(R, dtype=torch.int32, device=dev)
tiles = (R // BM) * (D // BN)
desc = TensorDescriptor.from_tensor(dst, [BM, 64])
desc2 = TensorDescriptor.from_tensor(dst, [64, BN])
variants = {
    "ce": (lambda: dst.copy_(x), None),
    "sm132.contig.cs": (lambda: _contig[(132,)](x, dst, R * D // 8192, BLOCK=8192, num_warps=8), None),
    "sm132.rows.ident": (lambda: _rows[(132,)](x, dst, ident, tiles, D=D, BM=BM, BN=BN, num_warps=8), None),
    "sm132.rows.perm": (lambda: _rows[(132,)](x, dst, perm, tiles, D=D, BM=BM, BN=BN, num_warps=8), "perm"),
    "sm264.rows.perm": (lambda: _rows[(264,)](x, dst, perm, tiles, D=D, BM=BM, BN=BN, num_warps=8), "perm"),
    "tma132.box128x64": (lambda: _tma[(132,)](x, desc, tiles, D=D, BM=BM, BN=64, num_warps=8), None),
    "tma264.box128x64": (lambda: _tma[(264,)](x, desc, tiles * 2, D=D, BM=BM, BN=64, num_warps=8), None),
    "tma132.box64x128": (lambda: _tma[(132,)](x, desc2, tiles * 2, D=D, BM=64, BN=BN, num_warps=4), None),
}
xs = [torch.empty(R, D, dtype=torch.bfloat16) for _ in range(ep)]
dist.all_gather(xs, x.cpu())
perms = [torch.empty(R, dtype=torch.int32) for _ in range(ep)]
dist.all_gather(perms, perm.cpu())
for name_v, (fn, kind) in variants.items():
    try:
        fn(); torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        if rank == 0:
            print(f"{name_v:18s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        dist.barrier()
        continue
    dist.barrier()
    ts = []
    for rep in range(9):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        s.record()
        for _ in range(5):
            fn()
        e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 5 * 1000)
    ts.sort()
    gbs = R * D * 2 / (ts[4] * 1e-6) / 1e9
    heap.barrier(); torch.cuda.synchronize(); dist.barrier()
    want = xs[peer]
    if kind == "perm":
        want = torch.empty_like(want)
        want[perms[peer].long()] = xs[peer]
    ok = torch.equal(mine.cpu().view(torch.int16), want.view(torch.int16))
    if rank == 0:
        print(f"{name_v:18s} {ts[4]:8.1f} us  {gbs:6.1f} GB/s  (fastest {ts[0]:.1f}) "
              f"bits ok={ok}", flush=True)
    mine.fill_(0); torch.cuda.synchronize(); dist.barrier()
heap.close()
dist.destroy_process_group()
