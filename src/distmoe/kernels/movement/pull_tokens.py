"""Pull the peer tokens a W13 gather table names into local memory, once per token (EP > 1).

W13 reads its A rows through ``gather_ptrs`` (absolute addresses of token rows in the owners'
dispatch buffers), once per column tile. On the rank's own memory the re-reads hit L2; a
GPU does not keep a peer's memory in its L2, so every re-read of a peer row crosses NVLink.
At T=8192, D=4096, F=2048, E=32, K=8 at EP=2 W13 has 16 column tiles, about 4.3 GB of NVLink
reads per rank, which makes the forward NVLink-bound (evidence: docs/performance.md). A token
routed to several experts of this rank is named by several rows of the table (about K/EP of
them), so the copy is keyed on the token rather than on the row: each needed peer token
crosses NVLink once.

With ``span = T_max * ROW_BYTES`` (the token rows 0..T_max-1 of each rank's dispatch buffer):

    owner(p)    = the rank s != rank with bases[s] <= src_ptrs[p] < bases[s] + span, if any
    slot(p)     = owner(p) * T_max + (src_ptrs[p] - bases[owner(p)]) / ROW_BYTES
    out_ptrs[p] = dst_base + slot(p) * ROW_BYTES     if owner(p) exists, else src_ptrs[p]
    dst[slot]   = the token row at bases[s] + t * ROW_BYTES, for every slot some row names

for every padded row p < R_cap (null, own and other addresses are left as they are). Two
launches: the first rewrites the table and flags the needed slots (``flags``, int8
``[EP * T_max]``), the second copies each flagged slot once and clears its flag, so the flags
are zero again for the next call. Grids come from the static ``R_cap`` and ``EP * T_max``;
no host synchronisation, so it runs inside CUDA-graph capture. The backward needs no pull:
W2 DGRAD already gathers each route's gradient row once (``grad_h3_out``) before its GEMM.

At small EP nearly every peer token is needed anyway (a token misses all of this rank's
experts with probability (1 - 1/EP)^K). :class:`distmoe.ops.context.MoEContext` then copies
every peer's token rows with the copy engines while the tables are built, and
``pull_tokens(..., pulled=True)`` only rewrites the table.

At EP = 1 nothing is pulled: ``pull_tokens(..., dst=None, own_src=x)`` rewrites the table so
that W13 reads the caller's x in place, and the forward skips its copy into the dispatch
buffer (kept in the tables for a backward's replay, which copies the saved x back there).

The copy reads the peers' rows where W13 would otherwise read them (after the same barrier,
before the next), so the safety argument of :mod:`distmoe.ops.context` and
:mod:`distmoe.ops.autograd` is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.checks import check_tensor
from distmoe.kernels.base.config import next_power_of_2
from distmoe.kernels.base.device import device_context

_BLOCK_R = 128
#: padded rows per entry of ``block_flags`` (one program of the table rewrite)
BLOCK_FLAG_ROWS = _BLOCK_R
_BLOCK_T = 16
_BLOCK_D = 512


@triton.jit
def _mark_tokens_kernel(src_ptrs_ptr, bases_ptr, out_ptrs_ptr, flags_ptr, enable_ptr,
                        block_flags_ptr, dst_base, own_base, r_cap, rank, T_MAX: tl.constexpr,
                        EP: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_R: tl.constexpr,
                        HAS_ENABLE: tl.constexpr, MARK: tl.constexpr, OWN: tl.constexpr,
                        BLOCK_FLAGS: tl.constexpr):
    if HAS_ENABLE:
        if tl.load(enable_ptr) == 0:
            return
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_cap = rows < r_cap
    src = tl.load(src_ptrs_ptr + rows, mask=in_cap, other=0)
    owner = tl.full([BLOCK_R], -1, tl.int32)
    owner_base = tl.zeros([BLOCK_R], dtype=tl.int64)
    for s in tl.static_range(EP):
        base = tl.load(bases_ptr + s)
        hit = (src >= base) & (src < base + T_MAX * ROW_BYTES) & (s != rank)
        owner = tl.where(hit, s, owner)
        owner_base = tl.where(hit, base, owner_base)
    pulled = in_cap & (src != 0) & (owner >= 0)
    slot = owner.to(tl.int64) * T_MAX + (src - owner_base) // ROW_BYTES
    kept = src
    if OWN:
        # this rank's own token rows, read from the caller's tensor instead of the dispatch
        # buffer (bases[rank] + t * ROW_BYTES -> own_base + t * ROW_BYTES)
        mine = tl.load(bases_ptr + rank)
        own = (src >= mine) & (src < mine + T_MAX * ROW_BYTES)
        kept = tl.where(own, own_base + (src - mine), src)
    tl.store(out_ptrs_ptr + rows, tl.where(pulled, dst_base + slot * ROW_BYTES, kept),
             mask=in_cap)
    if MARK:
        tl.store(flags_ptr + slot, tl.full([BLOCK_R], 1, tl.int8), mask=pulled)
    if BLOCK_FLAGS:
        # this program's BLOCK_R rows are one W13 row block (distmoe.kernels.w13_forward.phases)
        tl.store(block_flags_ptr + tl.program_id(0),
                 tl.max(pulled.to(tl.int32), axis=0).to(tl.int8))


@triton.jit
def _pull_tokens_kernel(bases_ptr, flags_ptr, dst_ptr, enable_ptr, T_MAX: tl.constexpr,
                        EP: tl.constexpr, ROW_ELEMS: tl.constexpr, COPY_ELEMS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_ENABLE: tl.constexpr):
    if HAS_ENABLE:
        if tl.load(enable_ptr) == 0:
            return
    slots = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = slots < EP * T_MAX
    need = tl.load(flags_ptr + slots, mask=in_range, other=0) != 0
    if tl.max(need.to(tl.int32), axis=0) > 0:
        owner = slots // T_MAX
        base = tl.load(bases_ptr + owner, mask=need, other=0)
        # Token rows and dst rows are 16-byte aligned (ROW_ELEMS * 2 is a multiple of 16):
        # the hints keep the copies 16-byte vectors.
        src_rows = tl.multiple_of(
            (base + (slots - owner * T_MAX) * (ROW_ELEMS * 2)).to(tl.pointer_type(tl.bfloat16)),
            16)
        dst_rows = tl.multiple_of(dst_ptr + slots * ROW_ELEMS, 16)
        for d in range(0, COPY_ELEMS, BLOCK_D):
            cols = d + tl.arange(0, BLOCK_D)
            mask = need[:, None] & (cols < COPY_ELEMS)[None, :]
            vals = tl.load(src_rows[:, None] + cols[None, :], mask=mask)
            tl.store(dst_rows[:, None] + cols[None, :], vals, mask=mask)
        tl.store(flags_ptr + slots, tl.zeros([BLOCK_T], dtype=tl.int8), mask=need)


def pull_tokens(src_ptrs: torch.Tensor, bases: torch.Tensor, rank: int,
                dst: torch.Tensor | None, flags: torch.Tensor | None, out_ptrs: torch.Tensor, *,
                enable: torch.Tensor | None = None, pulled: bool = False,
                own_src: torch.Tensor | None = None, t_max: int | None = None,
                block_flags: torch.Tensor | None = None,
                copy_elems: int | None = None) -> torch.Tensor:
    """Copy the peer tokens ``src_ptrs`` names into ``dst`` once each; returns ``out_ptrs``,
    the table W13 reads instead (see the module docstring). With ``pulled``, every peer
    token is already in ``dst`` (copied by the caller): only the table is written and
    ``flags`` may be ``None``.

    Args:
        src_ptrs: int64 ``[R_cap]`` absolute byte addresses of bf16 token rows (0 = null):
            ``bases[s] + t * D * 2`` for token ``t < T_max`` of rank ``s``.
        bases: int64 ``[EP]`` base addresses of every rank's dispatch buffer, as mapped here.
        rank: this rank (its own tokens are read in place).
        dst: bf16 ``[EP * T_max, D]`` contiguous local buffer; slot ``s * T_max + t`` receives
            token ``t`` of rank ``s`` when some row names it (other slots untouched). ``None``
            at EP = 1 only, with ``own_src`` and ``t_max``: nothing to pull, the table is
            rewritten to read ``own_src``.
        flags: int8 ``[EP * T_max]``, all zero before the call and again after it (allocate
            it with zeros once); not used with ``pulled`` (or ``dst=None``).
        out_ptrs: int64 ``[R_cap]`` (written).
        enable: optional int32 ``[1]`` on the device: 0 = nothing is read or written (the
            consumer is off too, as for a saved layer's replay steps).
        pulled: the peer tokens are in ``dst`` already; write the table only.
        own_src: optional bf16 ``[T, D]`` contiguous, 16-byte aligned, ``T <= T_max``: this
            rank's token rows. Rows naming this rank's own dispatch row ``t`` then name row
            ``t`` of ``own_src`` instead (the caller need not copy its tokens into its
            dispatch buffer).
        t_max: token rows per rank of the dispatch buffers, with ``dst=None`` only (else
            ``dst`` gives it).
        block_flags: optional int8 ``[R_cap / 128]`` (written): 1 where a block of 128
            padded rows names a peer token (a row rewritten to ``dst``), else 0; the W13 row
            blocks that :mod:`distmoe.kernels.w13_forward.phases` may run before the peer tokens
            have landed are the zeros.
        copy_elems: the first ``copy_elems`` elements of each pulled row only (a multiple of
            8, default D): rows that hold a packed format in their first bytes
            (:mod:`distmoe.kernels.scaled.nvfp4_rows`); the rest of a dst slot is untouched.
    Returns:
        ``out_ptrs``.
    """
    check_tensor("src_ptrs", src_ptrs, dtypes=(torch.int64,), ndim=1, shape_text="[R_cap]")
    r_cap = src_ptrs.shape[0]
    check_tensor("bases", bases, dtypes=(torch.int64,), ndim=1, shape_text="[EP]")
    ep = bases.shape[0]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ep:
        raise ValueError(f"rank ({rank!r}) must be an int in [0, EP={ep})")
    if own_src is not None:
        check_tensor("own_src", own_src, dtypes=(torch.bfloat16,), ndim=2, shape_text="[T, D]")
    if dst is None:
        if ep != 1 or own_src is None or t_max is None:
            raise ValueError(f"dst may be None only at EP = 1 with own_src and t_max (a table "
                             f"that reads the caller's rows), got EP={ep}, own_src "
                             f"{'given' if own_src is not None else 'None'}, t_max={t_max!r}")
        if isinstance(t_max, bool) or not isinstance(t_max, int) or t_max < 1:
            raise ValueError(f"t_max ({t_max!r}) must be a positive int")
        row_elems, device, pulled, dst_base = own_src.shape[1], own_src.device, True, 0
    else:
        if t_max is not None:
            raise ValueError(f"t_max ({t_max!r}) is for dst=None only: dst gives it")
        check_tensor("dst", dst, dtypes=(torch.bfloat16,), ndim=2,
                     shape_text="[EP * T_max, D]")
        if dst.shape[0] % ep or dst.shape[0] == 0:
            raise ValueError(f"dst must have EP * T_max rows (EP={ep}, T_max >= 1), got shape "
                             f"{list(dst.shape)}")
        t_max, row_elems = dst.shape[0] // ep, dst.shape[1]
        if (row_elems * 2) % 16 or dst.data_ptr() % 16:
            raise ValueError(f"dst rows must be 16-byte aligned, got D={row_elems} at address "
                             f"{dst.data_ptr():#x}")
        device, dst_base = dst.device, dst.data_ptr()
    if copy_elems is None:
        copy_elems = row_elems
    elif (isinstance(copy_elems, bool) or not isinstance(copy_elems, int)
          or not 8 <= copy_elems <= row_elems or copy_elems % 8):
        raise ValueError(f"copy_elems ({copy_elems!r}) must be a multiple of 8 (16-byte "
                         f"vectors) in [8, D = {row_elems}]")
    if not pulled:
        check_tensor("flags", flags, dtypes=(torch.int8,), shape=[ep * t_max],
                     shape_text="[EP * T_max]")
    check_tensor("out_ptrs", out_ptrs, dtypes=(torch.int64,), shape=[r_cap],
                 shape_text="[R_cap]")
    if enable is not None:
        check_tensor("enable", enable, dtypes=(torch.int32,), shape=[1], shape_text="(0 = skip)")
    if block_flags is not None:
        if r_cap % _BLOCK_R:
            raise ValueError(f"block_flags needs R_cap (rows of src_ptrs, {r_cap}) to be a "
                             f"multiple of {_BLOCK_R}")
        check_tensor("block_flags", block_flags, dtypes=(torch.int8,), shape=[r_cap // _BLOCK_R],
                     shape_text=f"[R_cap / {_BLOCK_R}]")
    if own_src is not None:
        if own_src.shape[1] != row_elems or own_src.shape[0] > t_max:
            raise ValueError(f"own_src must be [T <= {t_max}, {row_elems}], got "
                             f"{list(own_src.shape)}")
        if own_src.data_ptr() % 16:
            raise ValueError(f"own_src must be 16-byte aligned, got address "
                             f"{own_src.data_ptr():#x}")
    for name, t in (("src_ptrs", src_ptrs), ("bases", bases),
                    ("flags", src_ptrs if pulled else flags), ("out_ptrs", out_ptrs),
                    ("enable", src_ptrs if enable is None else enable),
                    ("own_src", src_ptrs if own_src is None else own_src),
                    ("block_flags", src_ptrs if block_flags is None else block_flags)):
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
    if r_cap == 0:
        return out_ptrs
    enable_arg = bases if enable is None else enable  # placeholder: never read
    flags_arg = out_ptrs if pulled else flags  # placeholder with pulled: never written
    with device_context(device):
        _mark_tokens_kernel[(triton.cdiv(r_cap, _BLOCK_R),)](
            src_ptrs, bases, out_ptrs, flags_arg, enable_arg,
            out_ptrs if block_flags is None else block_flags,  # placeholder: never written
            dst_base, 0 if own_src is None else own_src.data_ptr(), r_cap, rank,
            T_MAX=t_max, EP=ep, ROW_BYTES=row_elems * 2, BLOCK_R=_BLOCK_R,
            HAS_ENABLE=enable is not None, MARK=not pulled, OWN=own_src is not None,
            BLOCK_FLAGS=block_flags is not None,
        )
        if not pulled:
            _pull_tokens_kernel[(triton.cdiv(ep * t_max, _BLOCK_T),)](
                bases, flags, dst, enable_arg, T_MAX=t_max, EP=ep, ROW_ELEMS=row_elems,
                COPY_ELEMS=copy_elems, BLOCK_T=_BLOCK_T,
                BLOCK_D=min(_BLOCK_D, next_power_of_2(copy_elems)),
                HAS_ENABLE=enable is not None,
            )
    return out_ptrs
