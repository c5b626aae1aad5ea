"""The number formats of :mod:`distmoe.quant` and what its quantisers share.

Formats (bit layouts, rounding and the scale rules: docs/numerics.md):

* E4M3 (``torch.float8_e4m3fn``): sign, 4 exponent bits (bias 7), 3 fraction bits; largest
  finite 448, smallest normal 2^-6, smallest subnormal 2^-9; no infinity, NaN is
  ``0x7F`` / ``0xFF``.
* E8M0: an unsigned byte ``b`` meaning 2^(b - 127); ``0xFF`` is NaN (never produced here).
* E2M1: sign, 2 exponent bits (bias 1), 1 fraction bit: magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}, the code being the index in that list; no NaN, no infinity.

Shared here:

* :class:`QuantLaunchConfig`, the tile of every quantiser kernel;
* ``@triton.jit`` helpers: :func:`float32_bits` (a tile's float32 bit patterns),
  :func:`finite_abs_bits` (magnitude bits, 0 for NaN / Inf), :func:`e8m0_exponent` (the
  MXFP8 scale rule on an amax's bits), :func:`round_minifloat` (round-to-nearest-even of a
  float32 magnitude onto a small float format, in integer arithmetic), :func:`round_e4m3`
  (the same onto E4M3, by the hardware conversion in compiled kernels),
  :func:`e4m3_code_to_float`;
* their plain-PyTorch counterparts for the references, written independently in float64
  (:func:`e8m0_exponent_ref`, :func:`round_minifloat_ref`, :func:`pow2_ref`,
  :func:`sign_bits`);
* input validation (:func:`check_quant_input`, :func:`check_block_dim`,
  :func:`check_launch_config`).

The kernels round E2M1 in integer arithmetic on float32 bit patterns, and E4M3 with the GPU's
conversion instruction (:func:`round_e4m3`; the interpreter takes the integer path, which
gives the same codes); no libdevice call, nothing that flushes subnormals before rounding. The
only other float operations are IEEE float32 ones (``div_rn`` and exact multiplications by
powers of two). The references round in float64 with ``torch.round`` (half to even). Both
must agree bit for bit (tests/quant, on the CPU and on the GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmoe.kernels.base.interpreter import interpreter_active

#: Largest finite E4M3 magnitude.
E4M3_MAX = 448.0
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: E8M0 exponent bias: byte ``b`` means 2^(b - 127).
E8M0_BIAS = 127
#: Smallest and largest scale exponent an E8M0 byte holds (0xFF, NaN, excluded).
E8M0_EMIN, E8M0_EMAX = -127, 127
#: Values per MXFP8 scale (1 x 32 for activations, 32 x 32 for static weights).
MXFP8_BLOCK = 32
#: Values per NVFP4 block scale.
NVFP4_BLOCK = 16
#: E4M3 NaN byte (sign bit clear).
E4M3_NAN = 0x7F
#: Input dtypes every quantiser reads.
QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The E2M1 magnitudes in code order (code = index).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Compiled kernels round to E4M3 with the hardware conversion (sm_89 and later: one
#: ``cvt.rn.satfinite.e4m3x2.f32`` per two values, nearest even, saturating at 448), about a
#: tenth of the integer path's instructions, which made the quantisers compute-bound.
#: Triton 3.6's interpreter casts float32 to E4M3 wrongly (it truncates), so CPU runs keep
#: the integer path; both give the same codes.
E4M3_HARDWARE = tl.constexpr(not interpreter_active())


@dataclass(frozen=True, kw_only=True)
class QuantLaunchConfig:
    """Tile of a quantiser kernel: ``block_rows`` rows by ``block_groups`` scale blocks.

    Attributes:
        block_rows: rows per program (power of two, 1-256). The 32 x 32 weight kernel ignores
            it (its tile is 32 rows).
        block_groups: scale blocks per program along the quantised axis (power of two,
            1-64): 32 values each for MXFP8, 16 for NVFP4.
        num_warps: warps per program (1, 2, 4, 8 or 16).
    """

    block_rows: int = 32
    block_groups: int = 4
    num_warps: int = 4


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_launch_config(config: object) -> QuantLaunchConfig:
    """``config`` (None for the default) as a valid :class:`QuantLaunchConfig`."""
    if config is None:
        return QuantLaunchConfig()
    if not isinstance(config, QuantLaunchConfig):
        raise TypeError(f"config must be a QuantLaunchConfig or None, got {type(config).__name__}")
    if not (_pow2(config.block_rows) and config.block_rows <= 256):
        raise ValueError(f"config.block_rows ({config.block_rows}) must be a power of two "
                         "in [1, 256] (tl.arange extent)")
    if not (_pow2(config.block_groups) and config.block_groups <= 64):
        raise ValueError(f"config.block_groups ({config.block_groups}) must be a power of two "
                         "in [1, 64] (tl.arange extent)")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config.num_warps ({config.num_warps}) must be 1, 2, 4, 8 or 16")
    return config


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_quant_input(name: str, x: object, dim: object, block: int) -> int:
    """Validate a quantiser's input ``x`` and axis ``dim``; return ``dim`` made non-negative.

    ``x`` must be a bf16 / fp16 / fp32 tensor of at least one dimension whose size along
    ``dim`` is a multiple of ``block``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in QUANT_INPUT_DTYPES:
        raise TypeError(f"{name} must have dtype {_dtype_names(QUANT_INPUT_DTYPES)}, "
                        f"got {x.dtype}")
    return check_block_dim(name, x, dim, block)


def check_block_dim(name: str, x: torch.Tensor, dim: object, block: int) -> int:
    """``dim`` of ``x`` made non-negative; its size must be a multiple of ``block``."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim ({dim}) must be in [{-x.dim()}, {x.dim()}) for {name} of shape "
                         f"{list(x.shape)}")
    dim = dim % x.dim()
    if x.shape[dim] % block:
        raise ValueError(f"{name}.shape[{dim}] ({x.shape[dim]}) must be a multiple of {block} "
                         f"(values per scale block), got shape {list(x.shape)}")
    return dim


# --------------------------------------------------------------------------------------------
# @triton.jit helpers
# --------------------------------------------------------------------------------------------


def tile_grid(row_tiles: int, col_tiles: int) -> tuple[int]:
    """A one-axis launch grid of ``row_tiles x col_tiles`` programs, read back by
    :func:`tile_ids`: CUDA caps grid axes 1 and 2 at 65535 programs, fewer than the column tiles
    of a flattened expert weight (``[E, 2F * D]`` at DeepSeek's size)."""
    return (row_tiles * col_tiles,)


@triton.jit
def tile_ids(col_tiles):
    """``(row tile, column tile)`` of this program in a :func:`tile_grid` grid (row-major: the
    programs of one row tile are adjacent)."""
    pid = tl.program_id(0)
    return pid // col_tiles, pid % col_tiles


@triton.jit
def float32_bits(x):
    """Float32 bit patterns (int32) of a bf16, fp16 or fp32 tile, exact. bf16 is widened by a
    16-bit shift (what the GPU's conversion does): Triton 3.6's interpreter converts bf16
    subnormals to float32 wrongly, the shift is right on both."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return bits


@triton.jit
def finite_abs_bits(bits):
    """Magnitude bits (int32) of float32 bit patterns ``bits``; 0 for NaN and infinity, so
    that an integer ``max`` over them is the amax of the finite values (a non-negative
    float32's bits order like its value)."""
    a = bits & 0x7FFFFFFF
    return tl.where(a < 0x7F800000, a, 0)


@triton.jit
def e8m0_exponent(amax_bits):
    """MXFP8 scale exponent of a block from its amax's float32 bits (non-negative, finite):
    the smallest ``e`` in [-127, 127] with ``amax <= 448 * 2^e``.

    With ``amax = m * 2^u``, ``m`` in [1, 2): ``e = u - 8`` if ``m <= 1.75`` (448 = 1.75 * 2^8)
    else ``u - 7``. Zero and float32-subnormal amaxes give -127 (the clamp)."""
    biased = amax_bits >> 23
    frac = amax_bits & 0x7FFFFF
    e = biased - 135 + (frac > 0x600000).to(tl.int32)
    return tl.maximum(e, -127)


@triton.jit
def round_minifloat(abs_bits, exp_shift, MANT_BITS: tl.constexpr, EMIN: tl.constexpr,
                    MAX_CODE: tl.constexpr):
    """Code (sign excluded) of ``|v| * 2^-exp_shift`` rounded to nearest, ties to even, onto
    a float format with ``MANT_BITS`` fraction bits, smallest normal exponent ``EMIN`` and
    largest finite code ``MAX_CODE``; larger values saturate to ``MAX_CODE``.

    ``abs_bits``: int32 float32 bit patterns of finite magnitudes (sign bit clear);
    ``exp_shift``: int32, broadcast against it. E4M3: (3, -6, 126); E2M1: (1, 0, 7).

    Integer arithmetic only: the float32 significand ``sig`` (24 bits, implicit one set; a
    float32 subnormal is normalised through an exact int -> float conversion) is shifted right
    to the target quantum, ``2^(max(u, EMIN) - MANT_BITS)`` for a value in [2^u, 2^(u+1)), with
    round-half-even on the bits shifted out. A carry out of the significand moves into the
    exponent field by plain addition (the code is ``(max(u, EMIN) - EMIN) << MANT_BITS`` plus
    the rounded significand), which also turns the largest subnormal into the smallest
    normal."""
    biased = (abs_bits >> 23) & 0xFF
    frac = abs_bits & 0x7FFFFF
    # A float32 subnormal is frac * 2^-149; frac converts to float32 exactly (< 2^24).
    sub_bits = frac.to(tl.float32).to(tl.int32, bitcast=True)
    is_sub = biased == 0
    unb = tl.where(is_sub, ((sub_bits >> 23) & 0xFF) - 276, biased - 127) - exp_shift
    sig = tl.where(is_sub, sub_bits & 0x7FFFFF, frac) | 0x800000
    shift = (23 - MANT_BITS) + tl.maximum(EMIN - unb, 0)
    shift = tl.minimum(shift, 25)  # past 24 bits everything is below half the quantum
    q = sig >> shift
    rem = sig - (q << shift)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = q + up.to(tl.int32)
    code = ((tl.maximum(unb, EMIN) - EMIN) << MANT_BITS) + q
    code = tl.minimum(code, MAX_CODE)
    return tl.where(abs_bits == 0, 0, code)


@triton.jit
def round_e4m3(abs_bits, exp_shift):
    """``round_minifloat(abs_bits, exp_shift, 3, -6, 126)``: the E4M3 code (int32 in
    [0, 126], sign excluded) of ``|v| * 2^-exp_shift`` rounded to nearest even, saturated at
    448, for finite magnitude bits ``abs_bits`` (int32) and int32 ``exp_shift`` broadcast
    against them.

    Compiled (:data:`E4M3_HARDWARE`), the value is scaled by a float32 power of two built from
    its bits, which is exact while the product is a float32 normal, and converted by the
    hardware. The power is clamped to [2^-126, 2^127]: a shift above 126 is only met by values
    below 2^116 (every caller's: rebase shifts apply to E4M3 values, MXFP8 scale exponents
    are at most 120), whose results fall below 2^-10 and round to 0 either way; a product
    below the float32 normals, exact or not, also rounds to 0. A float32 subnormal ``v`` is
    scaled exactly (float32 multiplication keeps subnormals in Triton's compiled code)."""
    if E4M3_HARDWARE:
        t = tl.minimum(tl.maximum(-exp_shift, -126), 127)
        y = abs_bits.to(tl.float32, bitcast=True) * ((t + 127) << 23).to(tl.float32, bitcast=True)
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        return round_minifloat(abs_bits, exp_shift, 3, -6, 126)


@triton.jit
def round_e4m3_unscaled(abs_bits):
    """:func:`round_e4m3` with no shift: the E4M3 code of the finite float32 magnitudes
    ``abs_bits`` themselves (for values already divided by their scale)."""
    if E4M3_HARDWARE:
        y = abs_bits.to(tl.float32, bitcast=True)
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        return round_minifloat(abs_bits, 0, 3, -6, 126)


@triton.jit
def e4m3_code_to_float(code):
    """Float32 value of an E4M3 code without sign (int32 in [0, 126]), exact."""
    exp = code >> 3
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    return tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # man * 2^-9


@triton.jit
def e8m0_to_fp32(s):
    """fp32 ``2^(s - 127)`` of E8M0 bytes ``s`` (int32), exact: byte 0 is the fp32 subnormal
    2^-127, byte 255 is NaN."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_byte_to_fp32(b):
    """fp32 value of E4M3 bytes ``b`` (int32 0..255), exact, by bits: NaN for ``0x7F`` /
    ``0xFF`` (Triton 3.6's interpreter would decode those as +-480)."""
    mag = e4m3_code_to_float(b & 0x7F)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    # the sign by its bit (a negation would turn code 0x80, -0.0, into +0.0)
    return (mag.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------------------------
# Plain-PyTorch counterparts (float64; the references)
# --------------------------------------------------------------------------------------------


def e8m0_exponent_ref(amax: torch.Tensor) -> torch.Tensor:
    """The MXFP8 scale exponent (int32) of float64 block amaxes: the smallest ``e`` with
    ``amax <= 448 * 2^e``, clamped to [-127, 127] (0 gives -127)."""
    _, k = torch.frexp(amax)  # amax = f * 2^k, f in [0.5, 1): floor(log2 amax) = k - 1
    e = (k.to(torch.int32) - 1) - 8  # 448 < 2^9: e is this or one more
    e = e + (amax > E4M3_MAX * pow2_ref(e)).to(torch.int32)
    e = torch.where(amax == 0, E8M0_EMIN, e)
    return e.clamp(E8M0_EMIN, E8M0_EMAX)


def pow2_ref(e: torch.Tensor) -> torch.Tensor:
    """Float64 ``2^e`` of integer ``e`` in [-1022, 1023], built from its bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def round_minifloat_ref(y: torch.Tensor, mant_bits: int, emin: int,
                        max_value: float) -> torch.Tensor:
    """Finite float64 ``y`` rounded to nearest, ties to even, onto the grid of a float format
    with ``mant_bits`` fraction bits and smallest normal exponent ``emin``, saturated at
    ``max_value``; the sign (of zeros too) is kept. Every step is exact in float64."""
    mag = y.abs()
    _, k = torch.frexp(mag)
    binade = torch.clamp(k.to(torch.int32) - 1, min=emin)  # subnormals share emin's quantum
    quantum = pow2_ref(binade - mant_bits)
    rounded = torch.round(mag / quantum) * quantum  # torch.round: half to even
    return torch.clamp(rounded, max=max_value).copysign(y)


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    """The sign bit (int32 0 / 1) of every element of a bf16 / fp16 / fp32 tensor, NaN and
    zeros included, read from its bits."""
    if x.dtype == torch.float32:
        return (x.view(torch.int32) < 0).to(torch.int32)
    return (x.view(torch.int16) < 0).to(torch.int32)
