#!/usr/bin/env python3
"""Write-only, read-only and copy bandwidth of one GPU (GB/s, bytes moved / median time,
CUDA events over 20 repetitions): the ceilings a WGRAD's bf16 output stores (write-only)
and a weight stream (read-only) are held against."""
import torch

n = 4 << 30  # 4 GiB per buffer
a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
b = torch.empty_like(a)


def med(fn, reps=20):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2] / 1e3


w = med(lambda: b.fill_(1.5))
r = med(lambda: a.sum(dtype=torch.float32))
c = med(lambda: b.copy_(a))
print(f"write-only {n / w / 1e9:.0f} GB/s  read-only {n / r / 1e9:.0f} GB/s  "
      f"copy {2 * n / c / 1e9:.0f} GB/s (read + write)")
