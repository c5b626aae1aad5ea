"""Keep the routes to this rank's experts, one launch: step 2 of the collective transports
(:mod:`distmoe.ops.transport`), after the all-gather of every rank's expert ids.

    out[i]       = ids[i] - base   if 0 <= ids[i] < E and base <= ids[i] < base + E_local
                   -1              otherwise (another rank's expert, inactive or invalid)
    invalid[0]  += #{i : ids[i] < -1 or ids[i] >= E}                (int64, device counter)

Why one kernel: the same in PyTorch is about fifteen elementwise launches and a reduction per
call, a fixed cost that showed at the small suite shapes. Grid: ``max(1, ceil(numel /
BLOCK))`` programs from host sizes; no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_devices, check_tensor
from distmoe.kernels.base.device import device_context

_BLOCK = 1024


@triton.jit
def _local_routes_kernel(ids_ptr, out_ptr, invalid_ptr, numel, base, num_local, num_experts,
                         BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    v = tl.load(ids_ptr + i, mask=mask, other=-1)
    local = v - base
    mine = (v >= 0) & (v < num_experts) & (local >= 0) & (local < num_local)
    tl.store(out_ptr + i, tl.where(mine, local, -1), mask=mask)
    bad = tl.sum(((v < -1) | (v >= num_experts)).to(tl.int64), axis=0)
    if bad > 0:
        tl.atomic_add(invalid_ptr, bad)


def local_routes(ids: torch.Tensor, out: torch.Tensor, invalid: torch.Tensor, *, base: int,
                 num_local: int, num_experts: int) -> None:
    """Write this rank's local expert ids of ``ids`` into ``out`` and add the count of invalid
    ids to ``invalid`` (module docstring).

    Args:
        ids: contiguous int32 ``[N, K]`` (the gathered ids of every rank).
        out: contiguous int32 of ``ids``' shape (written whole).
        invalid: int64 scalar tensor (the context's invalid-id counter), added to.
        base / num_local: this rank's first expert and expert count; ``num_experts``: E.
    """
    check_tensor("ids", ids, dtypes=(torch.int32,), ndim=2, shape_text="[N, K]")
    check_tensor("out", out, dtypes=(torch.int32,), shape=list(ids.shape),
                 shape_text="ids' shape")
    check_tensor("invalid", invalid, dtypes=(torch.int64,), shape=[], shape_text="[] (scalar)")
    check_devices({"ids": ids, "out": out, "invalid": invalid})
    if not 0 <= base < num_experts or not 1 <= num_local <= num_experts - base:
        raise ValueError(f"base ({base}) and num_local ({num_local}) must name experts inside "
                         f"[0, {num_experts})")
    numel = ids.numel()
    if numel == 0:
        return
    with device_context(ids.device):
        _local_routes_kernel[(triton.cdiv(numel, _BLOCK),)](
            ids, out, invalid, numel, base, num_local, num_experts, BLOCK=_BLOCK)


def local_routes_ref(ids: torch.Tensor, *, base: int, num_local: int,
                     num_experts: int) -> tuple[torch.Tensor, int]:
    """Plain PyTorch: ``(out, invalid count)`` of :func:`local_routes`."""
    local = ids - base
    mine = (ids >= 0) & (ids < num_experts) & (local >= 0) & (local < num_local)
    bad = int(((ids < -1) | (ids >= num_experts)).sum())
    return torch.where(mine, local, -1), bad
