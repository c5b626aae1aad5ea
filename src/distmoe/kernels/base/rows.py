"""Row addresses and row tables on the host, for the plain-PyTorch references and tests.

Kernels receive absolute byte addresses of bf16 rows (rows of this process's tensors or of
peers' buffers mapped into this address space); :func:`rows_at` and :func:`write_rows_at` turn
those addresses back into (tensor, row) pairs so a reference can read and write the same rows.

Row layouts (the contract of every grouped kernel, forward and backward):

* **padded rows**, the tile schedule: ``R_cap`` rows, a multiple of ``block_m``;
  ``padded_offsets`` int32 ``[E_local + 1]`` on the device; local expert ``e`` owns rows
  ``[padded_offsets[e], padded_offsets[e+1])``, each segment a multiple of ``block_m``; rows
  at or beyond ``padded_offsets[E_local]`` are idle. Pointer tables (gather / scatter
  addresses) are indexed by padded row.
* **activation rows**, compact, what activation tensors hold: ``row_offsets`` int32
  ``[E_local + 1]``; expert ``e`` has ``n_e = row_offsets[e+1] - row_offsets[e]`` live rows;
  padded row ``padded_offsets[e] + j`` is live iff ``j < n_e`` and is activation row
  ``row_offsets[e] + j``. Padding rows are never stored and never contribute to a live output.

:func:`expert_segments`, :func:`activation_segments` and :func:`compact_segments` read the
tables on the host (they synchronise: references and tests only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` byte addresses of a contiguous tensor's elements."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def row_address(tensor: torch.Tensor, row: int | torch.Tensor, *, row_elems: int) -> torch.Tensor:
    """int64 absolute byte address of row ``row`` of ``tensor`` seen as rows of ``row_elems``."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous to address its rows")
    row = torch.as_tensor(row, dtype=torch.int64)
    return tensor.data_ptr() + row * (row_elems * tensor.element_size())


def locate_rows(
    addresses: torch.Tensor, tensors: Sequence[torch.Tensor], *, row_elems: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map absolute row addresses to ``(tensor index, row index)`` (CPU int64 tensors).

    Address 0 is a null row (tensor index -1). Every other address must be the start of a
    row of ``row_elems`` elements inside one of ``tensors`` (contiguous); otherwise a
    ``ValueError`` names the argument and the first offending address.
    """
    addr = addresses.detach().to("cpu", torch.int64).reshape(-1)
    which = torch.full_like(addr, -1)
    row = torch.zeros_like(addr)
    for i, tensor in enumerate(tensors):
        if not tensor.is_contiguous() or tensor.numel() % row_elems:
            raise ValueError(
                f"row source {i} must be contiguous with a multiple of {row_elems} elements, "
                f"got shape {list(tensor.shape)} strides {list(tensor.stride())}"
            )
        base = tensor.data_ptr()
        row_bytes = row_elems * tensor.element_size()
        offset = addr - base
        inside = (offset >= 0) & (offset < tensor.numel() * tensor.element_size())
        misaligned = inside & (offset % row_bytes != 0)
        if bool(misaligned.any()):
            bad = int(addr[misaligned][0])
            raise ValueError(f"{name} holds {bad:#x}, not the start of a row of tensor {i}")
        which[inside] = i
        row[inside] = offset[inside] // row_bytes
    unknown = (addr != 0) & (which < 0)
    if bool(unknown.any()):
        bad = int(addr[unknown][0])
        raise ValueError(f"{name} holds {bad:#x}, which lies in none of the given tensors")
    return which, row


def rows_at(
    addresses: torch.Tensor, tensors: Sequence[torch.Tensor], *, row_elems: int, name: str
) -> torch.Tensor:
    """Rows at ``addresses`` as ``[N, row_elems]`` float32 (zeros for null addresses)."""
    which, row = locate_rows(addresses, tensors, row_elems=row_elems, name=name)
    device = tensors[0].device if tensors else addresses.device
    out = torch.zeros(which.numel(), row_elems, dtype=torch.float32, device=device)
    for i, tensor in enumerate(tensors):
        hit = (which == i).nonzero().reshape(-1)
        if hit.numel():
            src = tensor.reshape(-1, row_elems)[row[hit].to(tensor.device)]
            out[hit.to(device)] = src.to(device=device, dtype=torch.float32)
    return out


def write_rows_at(
    addresses: torch.Tensor,
    values: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    name: str,
) -> None:
    """Write ``values[i]`` into the row at ``addresses[i]`` (skipped where the address is 0)."""
    row_elems = values.shape[-1]
    which, row = locate_rows(addresses, tensors, row_elems=row_elems, name=name)
    for i, tensor in enumerate(tensors):
        hit = (which == i).nonzero().reshape(-1)
        if hit.numel():
            rows_view = tensor.view(-1, row_elems)
            rows_view[row[hit].to(tensor.device)] = values[hit.to(values.device)].to(
                device=tensor.device, dtype=tensor.dtype
            )


def expert_segments(padded_offsets: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` row ranges of the local experts (host copy: references only)."""
    offsets = padded_offsets.detach().to("cpu", torch.int64).tolist()
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def activation_segments(
    padded_offsets: torch.Tensor, row_offsets: torch.Tensor
) -> list[tuple[int, int, int]]:
    """``[(padded_start, activation_start, live_rows)]`` per local expert (host copy: references
    and tests only; it synchronises)."""
    padded = padded_offsets.detach().to("cpu", torch.int64).tolist()
    act = row_offsets.detach().to("cpu", torch.int64).tolist()
    return [(padded[e], act[e], act[e + 1] - act[e]) for e in range(len(padded) - 1)]


def compact_segments(
    padded_offsets: torch.Tensor, row_offsets: torch.Tensor
) -> list[tuple[int, int, int]]:
    """``[(padded_start, act_start, n_e)]`` per local expert (host copy: references and tests
    only). Raises ``ValueError`` where the layout breaks its rules (``row_offsets[0] = 0``,
    ``0 <= n_e <=`` the padded segment length)."""
    padded = padded_offsets.detach().to("cpu", torch.int64).tolist()
    rows = row_offsets.detach().to("cpu", torch.int64).tolist()
    if len(padded) != len(rows):
        raise ValueError(
            f"row_offsets must have {len(padded)} entries like padded_offsets, got {len(rows)}"
        )
    if rows[0] != 0:
        raise ValueError(f"row_offsets[0] ({rows[0]}) must be 0")
    out = []
    for e in range(len(padded) - 1):
        count, seg = rows[e + 1] - rows[e], padded[e + 1] - padded[e]
        if not 0 <= count <= seg:
            raise ValueError(
                f"expert {e} has {count} live rows (row_offsets), which must be in [0, {seg}] "
                "(its padded segment length)"
            )
        out.append((padded[e], rows[e], count))
    return out
