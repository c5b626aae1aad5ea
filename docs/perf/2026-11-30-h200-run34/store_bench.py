"""Micro: 64 MiB of bf16 rows stored into the peer's heap buffer by SM stores, both ranks at
once, two H200s: Triton store cache modifiers and grid sizes, against the copy engines.
Every variant's result is checked bit for bit against the peer's source."""
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, "src")
from distmoe.runtime import create_heap  # noqa: E402


@triton.jit
def _push(src, dst, n_blocks, BLOCK: tl.constexpr, MOD: tl.constexpr):
    for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src + offs)
        tl.store(dst + offs, v, cache_modifier=MOD)


dist.init_process_group("gloo")
rank, ep = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
heap = create_heap(device=dev)
N = 32 << 20  # bf16 elements: 64 MiB
heap.allocate("rx", N * 2)
mine = heap.view("rx", rank, torch.bfloat16, (N,))
peer = 1 - rank
dst_peer = heap.view("rx", peer, torch.bfloat16, (N,))
x = torch.randn(N, device=dev).to(torch.bfloat16)
BLOCK = 8192
variants = {"ce": lambda: dst_peer.copy_(x)}
for mod in ("", ".cs", ".wt", ".cg"):
    for p in (66, 132, 264):
        variants[f"sm{p}{mod or '.default'}"] = (
            lambda p=p, mod=mod: _push[(p,)](x, dst_peer, N // BLOCK, BLOCK=BLOCK, MOD=mod,
                                             num_warps=8))
xs = [torch.empty(N, dtype=torch.bfloat16) for _ in range(ep)]
dist.all_gather(xs, x.cpu())
for name_v, fn in variants.items():
    fn(); torch.cuda.synchronize(); dist.barrier()
    ts = []
    for rep in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        s.record()
        for _ in range(5):
            fn()
        e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 5 * 1000)
    ts.sort()
    gbs = N * 2 / (ts[3] * 1e-6) / 1e9
    heap.barrier(); torch.cuda.synchronize(); dist.barrier()
    ok = torch.equal(mine.cpu().view(torch.int16), xs[peer].view(torch.int16))
    if rank == 0:
        print(f"{name_v:14s} {ts[3]:8.1f} us  {gbs:6.1f} GB/s  (fastest {ts[0]:.1f}) "
              f"bits ok={ok}", flush=True)
    mine.fill_(0); torch.cuda.synchronize(); dist.barrier()
heap.close()
dist.destroy_process_group()
