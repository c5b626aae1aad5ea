"""Inputs and checks shared by the quant tests.

* :func:`mixed_blocks`: a ``[rows, cols]`` tensor whose blocks each draw one kind of data
  (Gaussian at a random magnitude, values spanning 2^20 inside the block, tiny values down to
  the dtype's subnormals, signed powers of two, and values exactly halfway between two points
  of a rounding grid next to a block maximum that fixes the grid).
* :func:`mxfp8_bound` / :func:`nvfp4_bound`: the round-trip error bounds of docs/numerics.md.
"""

from __future__ import annotations

import torch

from distmoe.quant.formats import E2M1_VALUES, QuantLaunchConfig

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: One program covers a small test tensor (the interpreter runs programs one by one).
BIG_TILE = QuantLaunchConfig(block_rows=64, block_groups=16)
#: Several programs along both axes, with partial row and group tiles.
SMALL_TILE = QuantLaunchConfig(block_rows=8, block_groups=2, num_warps=2)
POISON = 0xFF

# Exponent range of the block magnitudes per dtype (fp16 tops out at 65504, its subnormals
# end at 2^-24).
_EXP_RANGE = {torch.float16: (-14, 5), torch.bfloat16: (-100, 100), torch.float32: (-100, 100)}
_TINY_EXP = {torch.float16: -22, torch.bfloat16: -130, torch.float32: -140}


def e4m3_values() -> torch.Tensor:
    """The 127 non-negative finite E4M3 values in increasing order (float64)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def midpoints(grid: torch.Tensor) -> torch.Tensor:
    """The points halfway between consecutive grid values (exact in float64)."""
    return (grid[1:] + grid[:-1]) / 2


def mixed_blocks(rows: int, cols: int, dtype: torch.dtype, block: int, gen: torch.Generator,
                 *, tie_grid: torch.Tensor, tie_top: float,
                 exp_range: tuple[int, int] | None = None) -> torch.Tensor:
    """``[rows, cols]`` of ``dtype`` on DEVICE, each block of ``block`` values along the last
    axis one of five kinds at a random magnitude 2^k, k in ``exp_range`` (default: most of
    the dtype's range); a "ties" block holds ``tie_top * 2^(k-3)`` (it fixes the block's
    grid) and values halfway between the points of ``tie_grid * 2^(k-3)``. Ties that fall
    below the dtype's subnormals are rounded by the cast (they are then ordinary values)."""
    lo, hi = exp_range or _EXP_RANGE[dtype]
    nb = cols // block
    out = torch.empty(rows, nb, block, dtype=torch.float64)
    kind = torch.randint(0, 5, (rows, nb), generator=gen)
    k = torch.randint(lo, hi + 1, (rows, nb, 1), generator=gen).to(torch.float64)
    gauss = torch.randn(rows, nb, block, generator=gen, dtype=torch.float64)
    spread = torch.randint(-20, 1, (rows, nb, block), generator=gen).to(torch.float64)
    wide = gauss.sign() * torch.exp2(k + spread.clamp(min=lo - k))
    tiny = gauss * 2.0 ** _TINY_EXP[dtype]
    pow2 = gauss.sign() * torch.exp2(k - torch.randint(0, 8, (rows, nb, block), generator=gen))
    mids = midpoints(tie_grid)
    pick = torch.randint(0, len(mids), (rows, nb, block), generator=gen)
    ties = mids[pick] * gauss.sign() * torch.exp2(k - 3)
    ties[..., 0] = tie_top * torch.exp2(k[..., 0] - 3)
    for i, data in enumerate((gauss * torch.exp2(k), wide, tiny, pow2, ties)):
        out = torch.where((kind == i)[..., None], data, out)
    return out.reshape(rows, cols).to(dtype).to(DEVICE)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) of non-zero float64 values (int64), exact."""
    return torch.frexp(x.abs())[1].to(torch.int64) - 1


def mxfp8_bound(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Round-trip bound 2^(max(floor(log2|x|), e - 6) - 4) of float64 ``x`` with block
    exponents ``e`` broadcast to it (zeros: 2^(e - 10))."""
    fl = torch.where(x == 0, torch.iinfo(torch.int64).min // 2, floor_log2(x))
    return torch.exp2(torch.maximum(fl, e.to(torch.int64) - 6).to(torch.float64) - 4)


def nvfp4_bound(x: torch.Tensor, decode: torch.Tensor, s_g: torch.Tensor) -> torch.Tensor:
    """Round-trip bound (2^-2 + 2^-21) max(|x|, D) + 6 * 2^-10 * s_g * (1 + 2^-21) + 2^-146
    of float64 ``x`` with its block's decode factor ``D`` and global scale ``s_g``."""
    return ((2.0**-2 + 2.0**-21) * torch.maximum(x.abs(), decode)
            + 6 * 2.0**-10 * s_g * (1 + 2.0**-21) + 2.0**-146)


E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
