"""Expert weights prepared once for a low-precision layer: :func:`prepare_weights`.

A low-precision :class:`~distmoe.MoEContext` (``MoEConfig(precision="mxfp8")``) takes its
expert weights already quantised, because static weights are quantised once per weight
version, not once per call. ``prepare_weights(w13, w2, "mxfp8")`` quantises each with the
32 x 32 weight quantiser (:func:`~distmoe.quant.mxfp8_quantize_weight`, docs/numerics.md
section 3) into a :class:`PreparedWeight` holding exactly what the MXFP8 grouped GEMM
(:func:`~distmoe.kernels.scaled.mxfp8_grouped_mm`) reads:

    w13 [E_local, 2, F, D] -> qdata float8_e4m3fn [E_local, 2, F, D],
                              scales uint8 E8M0 [E_local, 2, F/32, D/32]
    w2  [E_local, D, F]    -> qdata float8_e4m3fn [E_local, D, F],
                              scales uint8 E8M0 [E_local, D/32, F/32]

(the forward orientation: ``w[..., n, k] ~ qdata[..., n, k] * 2^(scales[..., n//32, k//32]
- 127)``; the same qdata will serve the input-gradient GEMM of MXFP8 training).

``prepare_weights(w13, w2, "nvfp4")`` quantises each expert matrix (``w13[e]`` as one
``[2F, D]`` matrix, ``w2[e]``) with :func:`~distmoe.quant.nvfp4_quantize` (docs/numerics.md
section 4) and one float32 global scale per expert matrix (``per="tensor"`` applied per
expert: ``s_g[e] = max(amax(w[e]) / 2688, 2^-126)``), blocks of 16 along the last dim (K of
the forward GEMM), for :func:`~distmoe.kernels.scaled.nvfp4_weight_grouped_mm`:

    w13 [E_local, 2, F, D] -> qdata uint8 [E_local, 2, F, D/2] (two E2M1 per byte, even element
                              in the low nibble), scales float8_e4m3fn [E_local, 2, F, D/16],
                              global_scale float32 [E_local]
    w2  [E_local, D, F]    -> qdata uint8 [E_local, D, F/2], scales float8_e4m3fn
                              [E_local, D, F/16], global_scale float32 [E_local]

(``w[e, ..., k] ~ v[e, ..., k] * s_b[e, ..., k // 16] * s_g[e]``).

``prepare_weights(w13, w2, "fp8_block")`` quantises each in 128 x 128 blocks with float32
scales (:func:`~distmoe.quant.fp8_block_quantize_weight`, DeepSeek-V3's layout), for
:func:`~distmoe.kernels.scaled.fp8_block_grouped_mm`:

    w13 [E_local, 2, F, D] -> qdata float8_e4m3fn [E_local, 2, F, D],
                              scales float32 [E_local, 2, F/128, D/128]
    w2  [E_local, D, F]    -> qdata float8_e4m3fn [E_local, D, F],
                              scales float32 [E_local, D/128, F/128]

(``w[..., n, k] ~ qdata[..., n, k] * scales[..., n//128, k//128]``). A checkpoint already in
that form (DeepSeek-V3's ``weight`` float8_e4m3fn with its ``weight_scale_inv``, per expert
stacked as above) loads without requantisation: :meth:`PreparedWeight.fp8_block`.

``prepare_weights(w13, w2, "mxfp4")`` (GPT-OSS's format, :mod:`distmoe.quant.mxfp4`): packed
E2M1 as nvfp4 with one uint8 E8M0 scale per 32 values along the last dim and no global scale;
a checkpoint's ``*_blocks`` / ``*_scales`` tensors load as they are
(:meth:`PreparedWeight.mxfp4`).

Memory: mxfp8 ``1 + 1/1024`` bytes per weight value, fp8_block ``1 + 1/4096``, nvfp4
``1/2 + 1/16`` (mxfp4 ``1/2 + 1/32``) (plus 4 bytes per
expert matrix); new tensors on the weights' device. Sync points: none (one quantiser launch,
two for nvfp4's amax, per weight). A :class:`PreparedWeight` saves and loads with
``torch.save`` / ``torch.load`` (also ``weights_only=True``: the class is registered with
``torch.serialization.add_safe_globals`` on import) and moves with :meth:`PreparedWeight.to`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from distmoe.quant.dequant import dequantize_rows_2d
from distmoe.quant.fp8_block import fp8_block_dequantize, fp8_block_quantize_weight
from distmoe.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from distmoe.quant.mxfp8 import e8m0_to_float, mxfp8_dequantize
from distmoe.quant.mxfp8_weight import mxfp8_quantize_weight, mxfp8_quantize_weight_ref
from distmoe.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize, nvfp4_quantize_ref

__all__ = ["PreparedWeight", "prepare_weights"]

#: precisions whose weights are prepared (bf16 takes its weights as they are)
PREPARED_PRECISIONS = ("mxfp8", "nvfp4", "fp8_block", "mxfp4")
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class PreparedWeight:
    """One expert weight quantised for a low-precision layer (:func:`prepare_weights`).

    Attributes:
        qdata: mxfp8: float8_e4m3fn, the source shape (``[E_local, 2, F, D]`` for w13,
            ``[E_local, D, F]`` for w2); nvfp4: uint8, the source shape with the last dim
            halved (two E2M1 codes per byte, the even element in the low nibble). Contiguous.
        scales: mxfp8: uint8 E8M0 exponents (bias 127), one per 32 x 32 block of the last two
            dims (the source shape with both last dims divided by 32); nvfp4: float8_e4m3fn
            block scales, one per 16 values along the last dim (the source shape with the
            last dim divided by 16). Contiguous.
            fp8_block: float32 scales, one per 128 x 128 block of the last two dims.
        shape: the source weight's shape (a tuple of ints).
        precision: ``"mxfp8"``, ``"nvfp4"`` or ``"fp8_block"``.
        global_scale: nvfp4: float32 ``[E_local]``, one global (decode) scale per expert
            matrix; None for mxfp8.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    precision: str
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.precision not in PREPARED_PRECISIONS:
            raise ValueError(f"precision ({self.precision!r}) must be one of "
                             f"{PREPARED_PRECISIONS}")
        if self.precision in ("nvfp4", "mxfp4"):
            self._check_fp4()
            return
        if self.global_scale is not None:
            raise ValueError(f"global_scale must be None for precision {self.precision!r}")
        if not isinstance(self.qdata, torch.Tensor) or self.qdata.dtype != torch.float8_e4m3fn:
            raise TypeError("qdata must be a float8_e4m3fn tensor, got "
                            f"{getattr(self.qdata, 'dtype', type(self.qdata).__name__)}")
        shape = tuple(self.shape)
        if tuple(self.qdata.shape) != shape or len(shape) < 2:
            raise ValueError(f"qdata must have the source shape {list(shape)} (at least 2-D), "
                             f"got {list(self.qdata.shape)}")
        b, dtype = (32, torch.uint8) if self.precision == "mxfp8" else (128, torch.float32)
        if shape[-2] % b or shape[-1] % b:
            raise ValueError(f"shape ({list(shape)}) must have its last two dims multiples of "
                             f"{b} for precision {self.precision!r}")
        want = [*shape[:-2], shape[-2] // b, shape[-1] // b]
        if (not isinstance(self.scales, torch.Tensor) or self.scales.dtype != dtype
                or list(self.scales.shape) != want):
            raise ValueError(f"scales must be {str(dtype).replace('torch.', '')} of shape "
                             f"{want} (one per {b} x {b} block), got "
                             f"{getattr(self.scales, 'dtype', None)} "
                             f"{list(getattr(self.scales, 'shape', []))}")
        if self.scales.device != self.qdata.device:
            raise ValueError(f"scales must be on qdata's device ({self.qdata.device}), got "
                             f"{self.scales.device}")
        object.__setattr__(self, "shape", shape)

    def _check_fp4(self) -> None:
        p = self.precision
        if not isinstance(self.qdata, torch.Tensor) or self.qdata.dtype != torch.uint8:
            raise TypeError(f"qdata must be a uint8 tensor (packed E2M1) for precision {p!r}, "
                            f"got {getattr(self.qdata, 'dtype', type(self.qdata).__name__)}")
        shape = tuple(self.shape)
        group, sdtype = (32, torch.uint8) if p == "mxfp4" else (16, torch.float8_e4m3fn)
        if len(shape) < 2 or shape[-1] % group:
            raise ValueError(f"shape ({list(shape)}) must be at least 2-D with the last dim a "
                             f"multiple of {group} for precision {p!r}")
        packed = [*shape[:-1], shape[-1] // 2]
        if list(self.qdata.shape) != packed or not self.qdata.is_contiguous():
            raise ValueError(f"qdata must be contiguous of shape {packed} (two E2M1 values per "
                             f"byte), got {list(self.qdata.shape)}")
        want = [*shape[:-1], shape[-1] // group]
        if (not isinstance(self.scales, torch.Tensor) or self.scales.dtype != sdtype
                or list(self.scales.shape) != want or not self.scales.is_contiguous()):
            raise ValueError(f"scales must be contiguous {str(sdtype).replace('torch.', '')} "
                             f"of shape {want} (one per {group} values), got "
                             f"{getattr(self.scales, 'dtype', None)} "
                             f"{list(getattr(self.scales, 'shape', []))}")
        if self.scales.device != self.qdata.device:
            raise ValueError(f"scales must be on qdata's device ({self.qdata.device}), got "
                             f"{self.scales.device}")
        if p == "mxfp4":
            if self.global_scale is not None:
                raise ValueError("global_scale must be None for precision 'mxfp4'")
            object.__setattr__(self, "shape", shape)
            return
        gs = self.global_scale
        if (not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32
                or list(gs.shape) != [shape[0]] or not gs.is_contiguous()):
            raise ValueError(f"global_scale must be a contiguous float32 tensor of shape "
                             f"[{shape[0]}] (one per expert matrix) for precision 'nvfp4', got "
                             f"{getattr(gs, 'dtype', type(gs).__name__)} "
                             f"{list(getattr(gs, 'shape', []))}")
        for name, t in (("scales", self.scales), ("global_scale", gs)):
            if t.device != self.qdata.device:
                raise ValueError(f"{name} must be on qdata's device ({self.qdata.device}), got "
                                 f"{t.device}")
        object.__setattr__(self, "shape", shape)

    def __reduce__(self):
        # a plain constructor call: torch.load(weights_only=True) accepts it for a registered
        # class (the default dataclass pickling sets fields one by one, which a frozen class
        # refuses)
        if self.global_scale is None:
            return (PreparedWeight, (self.qdata, self.scales, self.shape, self.precision))
        return (PreparedWeight, (self.qdata, self.scales, self.shape, self.precision,
                                 self.global_scale))

    @classmethod
    def fp8_block(cls, qdata: torch.Tensor, scale_inv: torch.Tensor) -> PreparedWeight:
        """A block-FP8 weight as a checkpoint stores it, without requantisation: ``qdata``
        float8_e4m3fn ``[E_local, 2, F, D]`` (w13: each expert's gate_proj then up_proj
        ``weight``) or ``[E_local, D, F]`` (w2: down_proj), ``scale_inv`` float32 with one
        value per 128 x 128 block (the ``weight_scale_inv`` tensors, stacked the same way;
        dequantised weight = qdata * scale_inv). Both made contiguous."""
        if not isinstance(qdata, torch.Tensor):
            raise TypeError(f"qdata must be a torch.Tensor, got {type(qdata).__name__}")
        return cls(qdata.contiguous(), scale_inv.contiguous() if isinstance(
            scale_inv, torch.Tensor) else scale_inv, tuple(qdata.shape), "fp8_block")

    @classmethod
    def mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor, *,
              interleaved: bool = False) -> PreparedWeight:
        """An MXFP4 weight as GPT-OSS checkpoints store it, without requantisation:
        ``blocks`` uint8 ``[E, N, K/32, 16]`` (the ``*_blocks`` tensors: 32 E2M1 values per
        16 bytes, the even element in the low nibble) and ``scales`` uint8 E8M0 ``[E, N,
        K/32]`` (``*_scales``), N the output features and K the input ones. For w13 pass
        ``gate_up_proj``'s (N = 2F; ``interleaved``: gate and up rows alternate, as GPT-OSS
        stores them, and are sorted into gate rows then up rows: ``[E, 2, F, K]``); for w2
        ``down_proj``'s (``[E, D, F]``). Made contiguous. (GPT-OSS's experts also have biases
        and a clamped SwiGLU; the layer runs plain SwiGLU without biases.)"""
        for name, t, nd in (("blocks", blocks, 4), ("scales", scales, 3)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != nd:
                raise TypeError(f"{name} must be a {nd}-D uint8 tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} "
                                f"{list(getattr(t, 'shape', []))}")
        E, N, G, B = blocks.shape
        if B != 16 or list(scales.shape) != [E, N, G]:
            raise ValueError(f"blocks must be [E, N, K/32, 16] and scales [E, N, K/32], got "
                             f"{list(blocks.shape)} and {list(scales.shape)}")
        qdata, sc = blocks.reshape(E, N, G * 16), scales
        shape: tuple[int, ...] = (E, N, G * 32)
        if interleaved:
            if N % 2:
                raise ValueError(f"interleaved gate/up rows need an even N, got {N}")
            qdata = torch.stack((qdata[:, 0::2], qdata[:, 1::2]), 1)
            sc = torch.stack((sc[:, 0::2], sc[:, 1::2]), 1)
            shape = (E, 2, N // 2, G * 32)
        return cls(qdata.contiguous(), sc.contiguous(), shape, "mxfp4")

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    def to(self, device: torch.device | str) -> PreparedWeight:
        """This weight on ``device`` (itself when it is there already)."""
        device = torch.device(device)
        if device == self.qdata.device:
            return self
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return PreparedWeight(self.qdata.to(device), self.scales.to(device), self.shape,
                              self.precision, gs)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """mxfp8: ``qdata * 2^(scale - 127)`` of every element as ``dtype`` (plain PyTorch,
        exact in float32); fp8_block: ``qdata * scale`` (exact in float64); nvfp4: ``fl32(v * fl32(s_b * s_g))``
        (:func:`~distmoe.quant.nvfp4_dequantize`). For references and tests."""
        if self.precision == "nvfp4":
            gs = self.global_scale.view(-1, *([1] * (len(self.shape) - 1)))
            return nvfp4_dequantize(self.qdata, self.scales, gs, dim=-1, dtype=dtype)
        if self.precision == "mxfp4":
            return mxfp4_dequantize(self.qdata, self.scales, dim=-1, dtype=dtype)
        if self.precision == "fp8_block":
            return fp8_block_dequantize(self.qdata, self.scales, dtype=dtype)
        rows = self.scales.repeat_interleave(32, dim=-2)
        return mxfp8_dequantize(self.qdata, rows, dim=-1, dtype=dtype)


torch.serialization.add_safe_globals([PreparedWeight])


def _check_weight(name: str, w: object, ndim: int, text: str) -> torch.Tensor:
    if isinstance(w, PreparedWeight):
        raise TypeError(f"{name} is a PreparedWeight already (prepare the bf16 weights once)")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {w.dtype}")
    if w.dim() != ndim:
        raise ValueError(f"{name} must be {text}, got shape {list(w.shape)}")
    return w


def prepare_weights(w13: torch.Tensor, w2: torch.Tensor, precision: str = "mxfp8", *,
                    reference: bool = False) -> tuple[PreparedWeight, PreparedWeight]:
    """Quantise a layer's expert weights once for ``MoEContext`` at ``precision``.

    Args:
        w13: ``[E_local, 2, F, D]`` (gate ``w13[e, 0]``, up ``w13[e, 1]``), bf16 / fp16 / fp32.
        w2: ``[E_local, D, F]``, same dtype family, same device as w13.
        precision: ``"mxfp8"`` (D and F multiples of 32): 32 x 32 block quantisation
            (:func:`~distmoe.quant.mxfp8_quantize_weight`, a Triton kernel: a CUDA device, or
            the CPU under Triton's interpreter); ``"nvfp4"`` (D and F multiples of 16): E2M1
            values, E4M3 scales per 16 along the last dim, one global scale per expert
            matrix (:func:`~distmoe.quant.nvfp4_quantize`, the module docstring);
            ``"fp8_block"`` (D and F multiples of 128): float32 scales per 128 x 128 block
            (:func:`~distmoe.quant.fp8_block_quantize_weight`, plain PyTorch); ``"mxfp4"``
            (D and F multiples of 32): E2M1 values with an E8M0 scale per 32 along the last
            dim (:func:`~distmoe.quant.mxfp4.mxfp4_quantize`, plain PyTorch).
        reference: quantise with the plain-PyTorch reference instead (any device; the same
            bits).

    Returns ``(w13_prepared, w2_prepared)``, :class:`PreparedWeight` each; gradients do not
    flow through (the weights are read detached).
    """
    if precision not in PREPARED_PRECISIONS:
        raise ValueError(f"precision ({precision!r}) must be one of {PREPARED_PRECISIONS} "
                         "(bf16 takes its weights as they are)")
    w13 = _check_weight("w13", w13, 4, "[E_local, 2, F, D] (gate, up)")
    w2 = _check_weight("w2", w2, 3, "[E_local, D, F]")
    num_experts, two, ffn, hidden = w13.shape
    if two != 2:
        raise ValueError(f"w13 must be [E_local, 2, F, D] (gate, up), got shape "
                         f"{list(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, ffn):
        raise ValueError(f"w2 must be [E_local={num_experts}, D={hidden}, F={ffn}] (from w13's "
                         f"shape), got {list(w2.shape)}")
    multiple, why = {"mxfp8": (32, "32 x 32 weight blocks"),
                     "nvfp4": (16, "one E4M3 scale per 16 values"),
                     "mxfp4": (32, "one E8M0 scale per 32 values"),
                     "fp8_block": (128, "128 x 128 weight blocks")}[precision]
    for name, value in (("D", hidden), ("F", ffn)):
        if value % multiple:
            raise ValueError(f"{name} ({value}) must be a multiple of {multiple} for precision "
                             f"{precision!r} ({why})")
    if w2.device != w13.device:
        raise ValueError(f"w2 must be on w13's device ({w13.device}), got {w2.device}")
    if precision == "nvfp4":
        return _prepare_nvfp4(w13, reference), _prepare_nvfp4(w2, reference)
    plain = {"fp8_block": fp8_block_quantize_weight,
             "mxfp4": lambda w: mxfp4_quantize(w, dim=-1)}.get(precision)
    if plain is not None:  # plain PyTorch: the same code with or without reference
        with torch.no_grad():
            prepared = [PreparedWeight(*plain(w.detach()), tuple(w.shape), precision)
                        for w in (w13, w2)]
        return prepared[0], prepared[1]
    quantize = mxfp8_quantize_weight_ref if reference else mxfp8_quantize_weight
    out = []
    with torch.no_grad():
        for w in (w13, w2):
            q = quantize(w.detach())
            out.append(PreparedWeight(q.qdata, q.scales, tuple(w.shape), precision))
    return out[0], out[1]


def _prepare_nvfp4(w: torch.Tensor, reference: bool) -> PreparedWeight:
    """One weight ``[E, ..., K]`` in NVFP4 with a global scale per expert matrix: each
    ``w[e]`` flattened is one row of ``nvfp4_quantize(per="row")`` (blocks of 16 along the
    flattened row are blocks along K since K % 16 == 0, and the packing order is the same)."""
    quantize = nvfp4_quantize_ref if reference else nvfp4_quantize
    num_experts = w.shape[0]
    with torch.no_grad():
        packed, scales, gs = quantize(w.detach().reshape(num_experts, -1), dim=-1, per="row")
    lead = tuple(w.shape[:-1])
    return PreparedWeight(packed.view(*lead, w.shape[-1] // 2).contiguous(),
                          scales.view(*lead, w.shape[-1] // 16).contiguous(), tuple(w.shape),
                          "nvfp4", gs.reshape(num_experts).contiguous())


def cached_per_object(owner: object, name: str, objects: tuple, make, *, size: int,
                      refresh=None):
    """``make()``, kept on ``owner`` (its attribute ``name``, a dict) for each of the last
    ``size`` tuples of ``objects`` it was asked for, keyed by the objects themselves (weak
    references: a new object at a freed one's address never matches) and, for tensors,
    their version counters (an in-place change, as an optimizer step, makes it again; with
    ``refresh``, ``refresh(value)`` updates the kept value in place instead, so that its
    tensors keep their addresses). Why: derived forms of static weights are made once per
    weight version, not once per call."""
    cache = owner.__dict__.setdefault(name, {})
    key = tuple(id(o) for o in objects)
    versions = tuple(getattr(o, "_version", 0) for o in objects)
    hit = cache.get(key)
    same = hit is not None and all(r() is o for r, o in zip(hit[0], objects, strict=True))
    if same and hit[1] == versions:
        return hit[2]
    if same and refresh is not None:
        refresh(hit[2])
        cache[key] = (hit[0], versions, hit[2])
        return hit[2]
    cache.pop(key, None)  # the stale value goes before the new one is made (peak memory)
    value = make()
    while len(cache) >= size:
        cache.pop(next(iter(cache)))  # the oldest
    cache[key] = (tuple(weakref.ref(o) for o in objects), versions, value)
    return value


def dequantize_rows(qdata: torch.Tensor, scales: torch.Tensor, fmt: str, *,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Values of FP8 activation rows ``qdata [R, K]`` (float8_e4m3fn) with their scales along
    K in operand format ``fmt``, as ``dtype`` (bf16 or float32), in one Triton pass
    (:func:`~distmoe.quant.dequant.dequantize_rows_2d`): ``"mxfp8"`` (uint8 E8M0
    ``[R, K/32]``) and ``"mxfp8_rebased"`` (uint8 E8M0 ``[R, K/128]``): exact;
    ``"fp8_block"`` (float32 ``[R, K/128]``): ``q * s`` in float32, rounded once to
    ``dtype``. The same bits as :func:`dequantize_rows_ref`. A new tensor."""
    out = torch.empty(qdata.shape, dtype=dtype, device=qdata.device)
    return dequantize_rows_2d(qdata, scales, fmt, out)


def dequantize_rows_ref(qdata: torch.Tensor, scales: torch.Tensor, fmt: str, *,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain-PyTorch :func:`dequantize_rows` (any device; float32 products, then ``dtype``)."""
    if fmt == "mxfp8":
        return mxfp8_dequantize(qdata, scales, dim=-1, dtype=dtype)
    if fmt == "mxfp8_rebased":
        return (qdata.float() * e8m0_to_float(scales).repeat_interleave(128, -1)).to(dtype)
    if fmt == "fp8_block":
        return fp8_block_dequantize(qdata, scales).to(dtype)
    raise ValueError(f"fmt ({fmt!r}) must be 'mxfp8', 'mxfp8_rebased' or 'fp8_block'")


def prepare_cached(owner: object, w13: torch.Tensor, w2: torch.Tensor, precision: str, *,
                   sources: tuple[torch.Tensor, ...] | None = None
                   ) -> tuple[PreparedWeight, PreparedWeight]:
    """:func:`prepare_weights` of ``(w13, w2)``, kept on ``owner`` (its attribute
    ``_distmoe_prepared``: the key and the pair) per weight version: quantised again only when
    ``precision`` or one of ``sources`` (the parameters the weights come from; default
    ``(w13, w2)``) has a new address or version counter (an in-place change: an optimizer
    step, a load). Why: static weights are quantised once per version, not once per call."""
    sources = (w13, w2) if sources is None else sources
    key = (precision,) + tuple((t.data_ptr(), t._version) for t in sources)
    cached = getattr(owner, "_distmoe_prepared", None)
    if cached is None or cached[0] != key:
        cached = (key, prepare_weights(w13.detach(), w2.detach(), precision))
        owner._distmoe_prepared = cached
    return cached[1]
