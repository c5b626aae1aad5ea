"""The rules that pick each kernel's launch config, one function per GEMM family.

Each rule is a pure function of the layer's widths (D = ``hidden``, F = ``ffn``), the
padding multiple ``block_m``, the rows per local expert (``rows_per_expert``: the shape key
``T_max * K / E_local``, never a routed count; ``None`` = unknown, which gives the plain
one-program-per-tile Triton configs that fit any width), the device class and the mode. The
numbers they compare against are rows of :mod:`distmoe.plan.thresholds`; what a kernel can
run at all (tiles, ring depths, widths) is the kernel's own check, which these call.

Shared shape of every Gluon pick: a Hopper device class, ``block_m`` 128 and a rows hint;
elsewhere the Triton kernel with tiles shrunk to the widths.
"""

from __future__ import annotations

from dataclasses import replace

from ..kernels.base.config import pow2_clamped
from ..kernels.base.gluon import gluon_device_reason
from ..kernels.mega.gluon import FusedConfig
from ..kernels.movement.combine import CombineConfig
from ..kernels.scaled.config import ScaledGemmConfig
from ..kernels.scaled.gluon import shape_reason as scaled_shape_reason
from ..kernels.scaled.wgrad import ScaledWgradConfig
from ..kernels.w2_dgrad.config import W2DgradConfig
from ..kernels.w2_dgrad.gluon import shape_reason as w2_dgrad_shape_reason
from ..kernels.w2_forward.config import W2Config
from ..kernels.w2_forward.gluon import shape_reason as w2_shape_reason
from ..kernels.w13_dgrad.config import W13DgradConfig
from ..kernels.w13_forward.config import W13Config
from ..kernels.w13_forward.gluon import shape_reason as w13_shape_reason
from ..kernels.wgrad.config import WgradConfig
from .thresholds import DeviceClass, Thresholds, thresholds


def _hopper(device_class: DeviceClass) -> bool:
    return device_class in ("h100", "h200")


def _in(value: int, bounds: tuple[int, int], *, closed: bool) -> bool:
    lo, hi = bounds
    return lo <= value <= hi if closed else lo <= value < hi


def gluon_mid_rows(t: Thresholds, rows_per_expert: int, num_experts: int | None,
                   weights_per_expert: int) -> bool:
    """Whether a Gluon forward runs at 64-127 rows per expert: the local expert count known
    and ``num_experts * weights_per_expert`` bf16 values under the mid-rows weight bound."""
    if num_experts is None or not 64 <= rows_per_expert < 128:
        return False
    return num_experts * weights_per_expert * 2 < t.value("gluon_mid_rows_weight_bytes")


# ------------------------------------------------------------------------------ W13 forward
def w13_forward_gluon(*, hidden: int, ffn: int, rows_per_expert: int, training: bool,
                      num_experts: int | None = None,
                      device_class: DeviceClass = "h100") -> W13Config | None:
    """The Gluon W13 forward config on a Hopper class, or ``None`` for the Triton kernel.

    Cooperative 128 x 128 tiles (8 MMA warps, 4 stages) from 128 rows, and in inference
    below 64 rows (decode: weights streamed once) or at 64-127 under the mid-rows weight
    bound; not where a partial last column tile wastes over 1/16 of F. Lockstep producers and
    expert-group order on the lockstep rows. Else, for training or long segments, ping-pong
    128 x 64 tiles (5 stages on long segments, else 6)."""
    t = thresholds(device_class)
    long_segments = rows_per_expert >= t.value("long_segment_rows")
    decode = not training and rows_per_expert < 64
    mid = not training and gluon_mid_rows(t, rows_per_expert, num_experts, 2 * ffn * hidden)
    candidates = []
    coop_waste = -(-ffn // 128) * 128 - ffn
    if (rows_per_expert >= 128 or decode or mid) and 16 * coop_waste <= ffn:
        lockstep = _in(rows_per_expert, t.value("lockstep_rows"), closed=False)
        candidates.append(W13Config(block_m=128, block_n=128, block_k=64, num_warps=8,
                                    num_stages=4, group_m=8, persistent=True, gluon=True,
                                    lockstep=lockstep, expert_groups=lockstep))
    if training or long_segments:
        candidates.append(W13Config(block_m=128, block_n=64, block_k=64, num_warps=4,
                                    num_stages=5 if long_segments else 6, group_m=8,
                                    persistent=True, gluon=True))
    for config in candidates:
        if w13_shape_reason(hidden=hidden, ffn=ffn, block_m=128, block_n=config.block_n,
                            block_k=64, stages=config.num_stages,
                            warps=config.num_warps) is None:
            return config
    return None


def w13_forward_config(*, hidden: int, ffn: int, block_m: int = 128,
                       rows_per_expert: int | None = None, training: bool = False,
                       num_experts: int | None = None,
                       device_class: DeviceClass = "generic") -> W13Config:
    """The W13 forward (gather + GEMM + SwiGLU) config.

    Triton: 128 x 128 x 64 tiles shrunk to the widths, 8 warps at a full tile, stages to
    fit 160 KiB; with a rows hint a persistent grid and stages to 200 KiB, except training
    on long segments (h1 and x stored too: 3 stages); the TMA epilogue for inference on long
    segments. On a Hopper class, :func:`w13_forward_gluon` where it picks."""
    if rows_per_expert is not None and block_m == 128 and _hopper(device_class):
        gluon = w13_forward_gluon(hidden=hidden, ffn=ffn, rows_per_expert=rows_per_expert,
                                  training=training, num_experts=num_experts,
                                  device_class=device_class)
        if gluon is not None:
            return gluon
    base = W13Config.for_widths(hidden=hidden, ffn=ffn, block_m=block_m)
    if rows_per_expert is None:
        return base
    long_segments = rows_per_expert >= thresholds(device_class).value("long_segment_rows")
    num_stages = base.num_stages
    if not (training and long_segments):  # the stages that fit 200 KiB
        per_stage = (block_m + 2 * base.block_n) * base.block_k * 2
        num_stages = max(2, min(4, (200 * 1024) // per_stage))
    return replace(base, num_stages=num_stages, persistent=True,
                   tma_epilogue=not training and long_segments)


# ------------------------------------------------------------------------------- W2 forward
def w2_forward_gluon(*, hidden: int, ffn: int, rows_per_expert: int, ep_size: int = 1,
                     num_experts: int | None = None,
                     device_class: DeviceClass = "h100") -> W2Config | None:
    """The Gluon W2 forward config on a Hopper class, or ``None`` for the Triton kernel:
    ping-pong 128 x 128 tiles with 6 stages from 128 rows, at 64-127 under the mid-rows
    weight bound where 128 divides D; lockstep on the lockstep rows where one expert's W2
    weights reach the W2 lockstep bound; expert-group order at EP=1 on its rows."""
    t = thresholds(device_class)
    groups = ep_size == 1 and _in(rows_per_expert, t.value("expert_groups_w2_rows"),
                                  closed=True)
    if rows_per_expert < 128 and (hidden % 128 or not gluon_mid_rows(
            t, rows_per_expert, num_experts, hidden * ffn)):
        return None
    lockstep = (_in(rows_per_expert, t.value("lockstep_rows"), closed=False)
                and 2 * hidden * ffn >= t.value("lockstep_w2_weight_bytes"))
    if w2_shape_reason(hidden=hidden, ffn=ffn, block_m=128, block_n=128, block_k=64,
                       stages=6, warps=4) is not None:
        return None
    return W2Config(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                    group_m=8, persistent=True, gluon=True, lockstep=lockstep,
                    expert_groups=groups)


def w2_forward_config(*, hidden: int, ffn: int, block_m: int = 128,
                      rows_per_expert: int | None = None, ep_size: int = 1,
                      num_experts: int | None = None,
                      device_class: DeviceClass = "generic") -> W2Config:
    """The W2 forward (GEMM + scatter epilogue) config. Triton: with a rows hint and
    D >= 256, 128 x 256 tiles on a persistent grid (3 stages on long segments, else 4);
    without, 128 x 128 x 64 tiles shrunk to the widths. On a Hopper class,
    :func:`w2_forward_gluon` where it picks."""
    if rows_per_expert is not None and block_m == 128 and _hopper(device_class):
        gluon = w2_forward_gluon(hidden=hidden, ffn=ffn, rows_per_expert=rows_per_expert,
                                 ep_size=ep_size, num_experts=num_experts,
                                 device_class=device_class)
        if gluon is not None:
            return gluon
    if rows_per_expert is not None and block_m == 128 and hidden >= 256 and ffn >= 64:
        long_segments = rows_per_expert >= thresholds(device_class).value("long_segment_rows")
        return W2Config(block_m=block_m, block_n=256, block_k=64, num_warps=8,
                        num_stages=3 if long_segments else 4, group_m=8, persistent=True)
    return W2Config.for_widths(hidden=hidden, ffn=ffn, block_m=block_m)


# -------------------------------------------------------------------------------- W2 DGRAD
def w2_dgrad_config(*, hidden: int, ffn: int, block_m: int = 128,
                    rows_per_expert: int | None = None, num_experts: int | None = None,
                    device_class: DeviceClass = "generic") -> W2DgradConfig:
    """The W2 DGRAD (+ SwiGLU backward) config. On a Hopper class with a rows hint: the
    Gluon kernel, 128 x 128 x 64 tiles with its epilogue in an 8-warp partition, 5 stages on
    long segments else 4, lockstep on its rows where the rank's W2 weights reach its bound,
    expert-group order on its rows. Triton: 128 x 256 tiles with a rows hint (F >= 256),
    else tiles shrunk to the widths, 4 stages."""
    if rows_per_expert is not None and block_m == 128 and _hopper(device_class) \
            and w2_dgrad_shape_reason(hidden=hidden, ffn=ffn) is None:
        t = thresholds(device_class)
        long_segments = rows_per_expert >= t.value("long_segment_rows")
        lockstep = (num_experts is not None
                    and _in(rows_per_expert, t.value("lockstep_w2_dgrad_rows"), closed=False)
                    and 2 * num_experts * hidden * ffn
                    >= t.value("lockstep_w2_dgrad_weight_bytes"))
        return W2DgradConfig(
            block_m=128, block_n=128, block_k=64, num_stages=5 if long_segments else 4,
            gluon=True, epilogue_warps=8, lockstep=lockstep,
            expert_groups=_in(rows_per_expert, t.value("expert_groups_w2_dgrad_rows"),
                              closed=True))
    if rows_per_expert is not None and block_m == 128 and ffn >= 256 and hidden >= 64:
        return W2DgradConfig(block_m=block_m, block_n=256, block_k=64, num_warps=8,
                             num_stages=4)
    return W2DgradConfig.for_widths(hidden=hidden, ffn=ffn, block_m=block_m)


# ------------------------------------------------------------------------------- W13 DGRAD
def w13_dgrad_gluon(*, hidden: int, ffn: int, rows_per_expert: int, num_experts: int | None,
                    device_class: DeviceClass = "h100") -> W13DgradConfig | None:
    """The Gluon W13 DGRAD config on a Hopper class, or ``None`` for the Triton kernel: from
    128 rows where the rank's W13 weights stay under the mid-rows weight bound and one
    expert's under the W13 DGRAD bound; ping-pong 128 x 128 tiles, 6 stages from 256 rows
    else 5; expert-group order on its rows."""
    t = thresholds(device_class)
    if rows_per_expert < 128 or num_experts is None:
        return None
    expert_bytes = 2 * ffn * hidden * 2
    if (num_experts * expert_bytes >= t.value("gluon_mid_rows_weight_bytes")
            or expert_bytes > t.value("gluon_w13_dgrad_expert_bytes")):
        return None
    stages = 6 if rows_per_expert >= 256 else 5
    if w2_shape_reason(hidden=hidden, ffn=ffn, block_m=128, block_n=128, block_k=64,
                       stages=stages, warps=4, w13_dgrad=True) is not None:
        return None
    return W13DgradConfig(
        block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=stages, group_m=8,
        persistent=True, gluon=True,
        expert_groups=_in(rows_per_expert, t.value("expert_groups_w13_dgrad_rows"),
                          closed=True))


def w13_dgrad_config(*, hidden: int, ffn: int, block_m: int = 128,
                     rows_per_expert: int | None = None, num_experts: int | None = None,
                     device_class: DeviceClass = "generic") -> W13DgradConfig:
    """The W13 DGRAD (+ scatter) config. Triton with a rows hint (D >= 256): 128 x 256
    tiles on a persistent grid whose tiles a counter hands out, an expert's short last tile
    paired with the one before; without, tiles shrunk to the widths. On a Hopper class,
    :func:`w13_dgrad_gluon` where it picks."""
    if rows_per_expert is not None and block_m == 128 and _hopper(device_class):
        gluon = w13_dgrad_gluon(hidden=hidden, ffn=ffn, rows_per_expert=rows_per_expert,
                                num_experts=num_experts, device_class=device_class)
        if gluon is not None:
            return gluon
    if rows_per_expert is not None and block_m == 128 and hidden >= 256 and ffn >= 32:
        return W13DgradConfig(block_m=block_m, block_n=256, block_k=64, num_warps=8,
                              num_stages=4, persistent=True, dynamic=True, pair_tails=True)
    return W13DgradConfig.for_widths(hidden=hidden, ffn=ffn, block_m=block_m)


# ------------------------------------------------------------------------------------ WGRAD
def _wgrad_wide_tiles(t: Thresholds, out_rows: int, out_cols: int,
                      rows_per_expert: int | None) -> bool:
    if not (out_rows >= 256 and out_cols >= 128
            and 2 * out_rows * out_cols >= t.value("wgrad_wide_tile_expert_bytes")):
        return False
    return rows_per_expert is None or rows_per_expert >= t.value("wgrad_wide_tile_min_rows")


def wgrad_gluon(*, out_rows: int, out_cols: int, block_m: int = 128,
                rows_per_expert: int | None = None, gathered_b: bool = False,
                device_class: DeviceClass = "h100") -> WgradConfig | None:
    """The warp-specialised Gluon WGRAD config on a Hopper class (``None`` where the shape
    does not fit it): 256 x 128 tiles where B is gathered (the W13 WGRAD reading kept input
    rows in place) or one expert's gradient reaches the wide-tile bound (lockstep producers
    from the lockstep bound); cooperative 128 x 128 on long segments (>= 256 columns); else
    ping-pong 128 x 128 (5 stages)."""
    if block_m < 64 or out_rows % 8 or out_rows < 128:
        return None
    t = thresholds(device_class)
    wide = WgradConfig(block_m=block_m, block_k=64, block_out_m=256, block_out_n=128,
                       num_warps=8, num_stages=3, gluon=True, specialized=True)
    if gathered_b and out_rows % 256 == 0 and out_cols >= 128:
        return wide
    if not gathered_b and _wgrad_wide_tiles(t, out_rows, out_cols, rows_per_expert):
        return replace(wide, lockstep=2 * out_rows * out_cols
                       >= t.value("wgrad_lockstep_expert_bytes"))
    if (rows_per_expert is not None and rows_per_expert >= t.value("long_segment_rows")
            and out_cols >= 256):
        return WgradConfig(block_m=block_m, block_k=64, block_out_m=128, block_out_n=128,
                           num_warps=8, num_stages=5, gluon=True, specialized=True)
    return WgradConfig(block_m=block_m, block_k=64, block_out_m=128,
                       block_out_n=pow2_clamped(out_cols, 16, 128), num_warps=4,
                       num_stages=5, gluon=True, specialized=True, pingpong=True)


def wgrad_config(*, out_rows: int, out_cols: int, block_m: int = 128,
                 rows_per_expert: int | None = None, gathered_b: bool = False,
                 device_class: DeviceClass = "generic") -> WgradConfig:
    """The grouped WGRAD config (``out_rows x out_cols`` per expert: D x F for W2, 2F x D for
    W13). On a Hopper class :func:`wgrad_gluon`; Triton: 128 x 256 tiles on long segments,
    else tiles shrunk to the output, 3 stages."""
    if _hopper(device_class):
        gluon = wgrad_gluon(out_rows=out_rows, out_cols=out_cols, block_m=block_m,
                            rows_per_expert=rows_per_expert, gathered_b=gathered_b,
                            device_class=device_class)
        if gluon is not None:
            return gluon
    if (rows_per_expert is not None
            and rows_per_expert >= thresholds(device_class).value("long_segment_rows")
            and out_rows >= 128 and out_cols >= 256):
        return WgradConfig(block_m=block_m, block_k=min(64, block_m), block_out_m=128,
                           block_out_n=256, num_warps=8, num_stages=3)
    return WgradConfig.for_widths(out_rows=out_rows, out_cols=out_cols, block_m=block_m)


# ---------------------------------------------------------------------------------- combine
def combine_config(*, hidden: int) -> CombineConfig:
    """The owner combine: one token of 1024 columns per program with 8 warps where
    D >= 1024 (the fastest of a sweep, evidence: docs/performance.md#run-33); narrower D
    packs more tokens per program up to 1024 elements, 4 warps."""
    base = CombineConfig.for_widths(hidden=hidden)
    return replace(base, num_warps=8 if base.block_d >= 1024 else 4)


# --------------------------------------------------------------------- per-call layer rules
def pull_all(*, ep_size: int, top_k: int, tokens: int, max_tokens: int,
             device_class: DeviceClass = "generic") -> bool:
    """Whether a forward of ``tokens`` tokens (buffers for ``max_tokens``) copies every
    peer's ``max_tokens`` rows (copy engines, beside the routing) rather than the rows its
    tables name: where the expected used fraction ``tokens / max_tokens * (1 - (1 -
    1/EP)^K)`` (uniform routing, this rank's count standing for its peers') reaches the
    pull-all threshold. At full buffers: EP=2 with K >= 4, EP=3 with K >= 6, not EP=4 with
    K=8. Either way gives the same bits."""
    if ep_size <= 1 or max_tokens <= 0:
        return False
    used = tokens / max_tokens * (1 - (1 - 1 / ep_size) ** top_k)
    return used >= thresholds(device_class).value("pull_all_fraction")


def fp4_weight_gemm(*, k: int, n: int, swiglu: bool = False, block_m: int,
                    rows_per_expert: int, device_class: DeviceClass = "generic",
                    swap_rows: int | None = None) -> ScaledGemmConfig:
    """The FP4-weight grouped GEMM's config (NVFP4 / MXFP4 inference, bf16 activations):
    below ``swap_rows`` rows per expert (default: the ``fp4_swap_rows`` threshold; decode),
    transposed tiles (``swap_ab``) of 32 token rows by 64 weight rows, K in steps of 128, one
    warpgroup: the decoded weights feed the MMA from registers and a few tokens fill its N
    side, where a 128-row tile would spend 16x the tensor-core work of its live rows and
    hold fewer programs per SM (measured: the threshold's row); else
    :meth:`ScaledGemmConfig.for_widths` at the padding multiple ``block_m`` (which the
    transposed tile's 32 rows must divide)."""
    if swap_rows is None:
        swap_rows = fp4_swap_rows(device_class)
    if rows_per_expert < swap_rows and block_m % 32 == 0:
        return ScaledGemmConfig(block_m=32, block_n=64, block_k=128, num_warps=4,
                                num_stages=3, group_m=1, swap_ab=True)
    return ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu, block_m=block_m)


def fp4_swap_rows(device_class: DeviceClass = "generic") -> int:
    """The rows per expert below which :func:`fp4_weight_gemm` picks transposed tiles (the
    ``fp4_swap_rows`` threshold); an inference context also compares each call's rows with
    it (:meth:`distmoe.ops.lowp.NVFP4Scratch.configs`)."""
    return thresholds(device_class).value("fp4_swap_rows")


def fp4_fp8_operands(*, hidden: int, ffn: int, rows_per_expert: int,
                     device_class: DeviceClass = "generic") -> bool:
    """Whether an NVFP4 / MXFP4 inference layer quantises its activations to FP8 (1 x 128
    blocks) and expands the weights to E4M3 (:func:`~distmoe.kernels.scaled.nvfp4.
    nvfp4_weight_fp8_mm`: FP8 tensor cores, two extra quantisation passes) instead of
    expanding them to bf16 beside bf16 activations: from the ``fp4_fp8_min_rows`` threshold
    of rows per expert, where D and F are multiples of 128."""
    if hidden % 128 or ffn % 128:
        return False
    return rows_per_expert >= thresholds(device_class).value("fp4_fp8_min_rows")


def packs_nvfp4_rows(*, precision: str, ep_size: int) -> bool:
    """Whether token owners pack their rows as NVFP4 before the experts read them
    (:mod:`distmoe.kernels.scaled.nvfp4_rows`): nvfp4 at EP > 1, where rows cross between
    GPUs and the packed row is 3.6x fewer bytes. At EP = 1 the expert reads x in place (a
    pack would read and write it once more and add the activations' quantisation error for
    no bytes saved); mxfp4 keeps bf16 activations (GPT-OSS's recipe quantises weights
    only)."""
    return precision == "nvfp4" and ep_size > 1


def w13_phases(*, max_tokens: int, top_k: int, num_experts: int,
               device_class: DeviceClass = "generic") -> bool:
    """Whether W13 runs in two launches around the peer copy (where its tiles are the
    copy's 128-row blocks): from the W13-phases threshold of rows per local expert from one
    source rank, ``max_tokens * top_k / num_experts``."""
    return (max_tokens * top_k // num_experts
            >= thresholds(device_class).value("w13_phases_min_own_rows"))


def pipeline_for(pipeline: str, *, training: bool, ep_size: int) -> str:
    """The forward pipeline a layer runs: ``"mega"`` where asked for (the context refuses it
    where it cannot run), else ``"staged"``. ``"auto"`` is staged everywhere: Mega has not
    been measured clearly faster at any shape (evidence: docs/performance.md#run-36)."""
    del training, ep_size  # the rule reads them once Mega wins somewhere by a clear margin
    return "mega" if pipeline == "mega" else "staged"


def mega_config(*, pingpong: bool = True, lag: int = 3, dynamic: bool = False) -> FusedConfig:
    """The fused W13 + W2 kernel's config: ping-pong 128 x 64 / 128 x 128 tiles with 6
    stages, or cooperative 128 x 128 / 128 x 256 with 4; ``lag`` row-block groups between a
    group's W13 and W2 tiles; ``dynamic`` hands tiles out at run time."""
    if pingpong:
        return FusedConfig(block_n=64, warps=4, stages=6, lag=lag, dynamic=dynamic)
    return FusedConfig(block_n=128, warps=8, stages=4, lag=lag, dynamic=dynamic)


def mxfp8_k_group(*, hidden: int, ffn: int) -> int:
    """Values per activation scale along K in the MXFP8 layer's GEMMs: 128 (the operands
    rebased onto 128-wide groups, :func:`distmoe.quant.mxfp8_rebase`: one promotion per four
    FP8 MMAs) where D and F are multiples of 128, else 32 (exact MXFP8, a promotion per MMA).
    Why: the rebased GEMM measured several times faster than the exact one (evidence:
    docs/performance.md, section "FP8 (issue 58)"); it changes only values that fall below
    E4M3's subnormal step at the group's scale, and on SM90 the 128-deep MMA chain
    accumulates with a narrower significand (docs/numerics.md sections 6 and 9)."""
    return 128 if hidden % 128 == 0 and ffn % 128 == 0 else 32


#: Whether the FP8 layers' plan picks the warp-specialised Gluon forms of the block-scaled
#: GEMM and of the FP8 weight gradient on Hopper (:func:`scaled_gluon`). Off until their GPU
#: tests have passed and the A/B has measured them (docs/performance.md, "Not measured yet");
#: the configs exist and run when passed explicitly.
PICK_GLUON_SCALED = True


def scaled_gluon(device) -> bool:
    """Whether the FP8 layers on ``device`` take the Gluon forms (:data:`PICK_GLUON_SCALED`
    and a device that runs Gluon kernels): the ``gluon`` argument of :func:`scaled_gemm` and
    :func:`fp8_wgrad`."""
    return PICK_GLUON_SCALED and gluon_device_reason(device) is None


def scaled_gemm(*, k: int, n: int, swiglu: bool = False, k_group: int, block_m: int,
                gluon: bool) -> ScaledGemmConfig:
    """The block-scaled grouped GEMM's config (FP8 layers' W13, W2 and input-gradient GEMMs):
    K = ``k``, ``n`` weight rows per expert (2F with ``swiglu``), ``k_group`` values per
    scale along K, ``block_m`` the padding multiple, ``gluon`` whether to take the Gluon form
    (:func:`scaled_gluon`). With ``gluon``, the warp-specialised Gluon kernel (128 x 128 x 128
    tiles, 5 stages) wherever it can tile the case (128-wide K groups, K a multiple of 128, N
    of 128 or F of 64); else the Triton kernel's :meth:`~ScaledGemmConfig.for_widths`. Why:
    on the Triton kernel the promotions stall the tensor cores (evidence:
    docs/performance.md, section "FP8 (issue 58)")."""
    cfg = ScaledGemmConfig(block_m=block_m, block_n=64 if swiglu else 128, block_k=128,
                           num_warps=8, num_stages=5, gluon=True)
    if gluon and scaled_shape_reason(
            k=k, n=n, swiglu=swiglu, k_group=k_group, block_m=block_m, block_n=cfg.block_n,
            block_k=cfg.block_k, stages=cfg.num_stages, warps=cfg.num_warps) is None:
        return cfg
    return ScaledGemmConfig.for_widths(k=k, n=n, swiglu=swiglu, block_m=block_m,
                                       k_group=k_group)


#: Whether the FP8 training layer takes FP8 weight gradients (:func:`fp8_wgrad`) where they
#: apply. Off: even with the Gluon GEMMs they were slower than the bf16 weight gradients
#: (their four token-axis quantisation passes; evidence: docs/performance.md#run-68). The
#: recipe stays available (``fp8_train_configs(..., fp8_wgrad=True)``) until fused
#: quantisation makes it pay.
PICK_FP8_WGRAD = False


def fp8_wgrad(*, fmt: str, row_block: int, out_rows: int, out_cols: int, gluon: bool,
              pick: bool | None = None) -> ScaledWgradConfig | None:
    """The FP8 training layer's weight-gradient GEMM for one weight (``out_rows x out_cols``
    per expert), or None for the bf16 WGRAD (:mod:`distmoe.kernels.wgrad`). With ``pick``
    (default :data:`PICK_FP8_WGRAD`): FP8, on operands quantised along tokens in 128-token
    blocks (:mod:`distmoe.kernels.scaled.wgrad`), where the operand format has 128-wide
    groups (``"fp8_block"``, ``"mxfp8_rebased"``) and the padding multiple ``row_block`` is a
    multiple of 128 (a token block never spans two experts); with ``gluon``
    (:func:`scaled_gluon`) the Gluon form where both widths are multiples of 128. Why: the
    issue's recipe (WGRAD operands quantised along the token axis) at the FP8 rate, for the
    third of the training FLOPs that the weight gradients are."""
    if not (PICK_FP8_WGRAD if pick is None else pick):
        return None
    if fmt not in ("fp8_block", "mxfp8_rebased") or row_block % 128:
        return None
    tiles = out_rows % 128 == 0 and out_cols % 128 == 0
    if gluon and tiles:
        return ScaledWgradConfig(block_m=128, block_n=128, num_warps=8, num_stages=5,
                                 gluon=True)
    return ScaledWgradConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
