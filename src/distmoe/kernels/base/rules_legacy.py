"""Heuristic thresholds of the kernel configs' ``from_heuristic`` / ``hopper_gluon`` rules.

TEMPORARY home (issue 57): these constants and rule helpers moved here unchanged from the
former ``kernels/base/``; they move on into a plan module, after which the configs import
them from there.
"""

from __future__ import annotations

#: Bytes of expert weights (bf16, over the rank's local experts) that a Gluon W13 or W2
#: forward must stream less of to run at 64-127 rows per expert. Fitted to one and two H200s,
#: inference, interleaved A/Bs (docs/performance.md run 38): with the Gluon kernels the layer
#: forward was 2-10% faster where the kernels stream 0.3-1.1 GB (D=2048 F=768 E=128 and 64,
#: D=2048 F=1024 E=64, D=4096 F=2048 E=32), and even to 2.7% slower at 4.3-15 GB (D=4096 and
#: 7168, F=2048, E=256 at EP=1, E=128 at EP=2). The bound sits between, where nothing was
#: measured (2 GiB itself, the W2 at D=4096 F=2048 E=128, ran only as Triton), and why the
#: weights' size decides was not established (at these rows the kernels stream weights).
GLUON_MID_ROWS_WEIGHT_BYTES = 2 * 1024**3


def gluon_mid_rows(rows_per_expert: int, num_experts: int | None,
                   weights_per_expert: int) -> bool:
    """Whether a Gluon forward kernel runs at a ``rows_per_expert`` hint of 64-127: only
    with the local expert count known and ``num_experts * weights_per_expert`` bf16 values
    (``2 F D`` for W13, ``D F`` for W2) under :data:`GLUON_MID_ROWS_WEIGHT_BYTES`."""
    if num_experts is None or not 64 <= rows_per_expert < 128:
        return False
    return num_experts * weights_per_expert * 2 < GLUON_MID_ROWS_WEIGHT_BYTES


#: Rows per expert (the heuristics' hint) at which the Gluon W13 forward's producers run in
#: lockstep (``W13Config.lockstep``), from the first to before the second; the Gluon W2
#: forward's too where each expert's W2 weights hold at least
#: :data:`LOCKSTEP_W2_WEIGHT_BYTES` (docs/performance.md runs 51-52).
LOCKSTEP_ROWS = (128, 192)
#: see :data:`LOCKSTEP_ROWS`: W2 lockstep measured 2.5-5.4% faster (forward) at 16.6 and
#: 29 MB per expert, 1% slower at 3 MB
LOCKSTEP_W2_WEIGHT_BYTES = 8 * 1024**2


#: Rows per expert (the heuristic's hint) at which the Gluon W2 DGRAD's TMA producer runs in
#: lockstep (``W2DgradConfig.lockstep``), from the first to before the second, where the
#: rank's W2 weights total at least :data:`LOCKSTEP_W2_DGRAD_WEIGHT_BYTES` (docs/performance.md
#: run 53: the kernel alone 1.05x at DeepSeek-V3's 7.5 GB and 1.10x at DeepSeek-V4-Flash's
#: 4.3 GB; even at GPT-OSS-120B's 2.1 GB, 0.95x at 0.4 GB)
LOCKSTEP_W2_DGRAD_ROWS = (96, 192)
#: see :data:`LOCKSTEP_W2_DGRAD_ROWS`
LOCKSTEP_W2_DGRAD_WEIGHT_BYTES = 3 * 1024**3


#: Rows per expert (the heuristic's hint, first to last) at which the Gluon W2 forward walks
#: its tiles in expert-group order at EP=1 (``W2Config.expert_groups``; run 59, one H100,
#: interleaved: the layer forward 1.010-1.041x at 128 to 1024 rows per expert, 0.967x at
#: 2048; run 60: the kernel in DeepSeek-V3's training step 3.10 against 3.37 ms, the fwd+bwd
#: step 1.011x there, 1.009x / 1.000x at GPT-OSS-120B / OLMoE)
EXPERT_GROUPS_W2_ROWS = (128, 1024)
#: The same for the Gluon W13 DGRAD (``W13DgradConfig.expert_groups``; run 59: the fwd+bwd
#: step 1.043x twice at 256 rows per expert under sampled routing, 1.006x exact, 1.009x at
#: 512, 0.951x at 2048; run 60, Nsight Compute: the kernel in the step 1.05-1.09x at 128
#: rows per expert, 1.25x at 256, 1.18x at 512, 0.986x at 1024; the kernel takes no fewer
#: than 128)
EXPERT_GROUPS_W13_DGRAD_ROWS = (128, 512)
#: The same for the Gluon W2 DGRAD (``W2DgradConfig.expert_groups``, at every EP size: it
#: reads its gradient rows from the rank's own scratch). Run 60, one H100, Nsight Compute on
#: the kernel in the fwd+bwd step: 3.4-11% faster at 96-512 rows per expert (DeepSeek-V3
#: 3.07 against 3.34 ms, reading 8.38 GB instead of 9.10), even at 1024 (0.98x / 1.004x),
#: 12% slower at 2048; run 61: 1.033x at 32 rows (DeepSeek-V3, T=1024), 1.099x / 1.018x /
#: 1.018x at 64 (DeepSeek-V3, GPT-OSS-120B, OLMoE); run 62: 1.027x / 1.022x at 16 / 24
#: (DeepSeek-V3, T=512 / 768), 1.037x / 1.023x at 768 (OLMoE T=6144, Qwen3-30B-A3B
#: T=12288), at 1024 0.984x / 0.83x (the two at T=8192 / 16384); the layer even at 16 and
#: 768 (1.0003x, 1.0008x); not measured below 16 or at 769-1023
EXPERT_GROUPS_W2_DGRAD_ROWS = (16, 768)


def lockstep_rows(rows_per_expert: int) -> bool:
    """Whether a ``rows_per_expert`` hint lies in :data:`LOCKSTEP_ROWS`."""
    return LOCKSTEP_ROWS[0] <= rows_per_expert < LOCKSTEP_ROWS[1]


def w2_dgrad_lockstep(*, rows_per_expert: int, num_experts: int | None, hidden: int,
                      ffn: int) -> bool:
    """Whether the Gluon W2 DGRAD's producer runs in lockstep (:data:`LOCKSTEP_W2_DGRAD_ROWS`):
    the hint in that range and the rank's ``num_experts * hidden * ffn`` bf16 W2 weights at
    least :data:`LOCKSTEP_W2_DGRAD_WEIGHT_BYTES`; never without the expert count."""
    lo, hi = LOCKSTEP_W2_DGRAD_ROWS
    return (num_experts is not None and lo <= rows_per_expert < hi
            and 2 * num_experts * hidden * ffn >= LOCKSTEP_W2_DGRAD_WEIGHT_BYTES)


#: Bytes of one expert's weight gradient (``out_rows * out_cols`` bf16) from which the Gluon
#: WGRAD takes 256 x 128 output tiles (:meth:`~distmoe.kernels.wgrad.config.WgradConfig.
#: hopper_gluon`): each row of its B operand loaded once per 256 output rows instead of 128.
#: Layer fwd+bwd on one H100 (docs/performance.md run 54, sampled routing): 2.1-13.2% faster
#: at 15.8-56 MiB per expert (DeepSeek-V3 and V4-Flash, GPT-OSS-120B, T=8192 D=4096 F=2048
#: E=32), 3% slower or even at 3-8 MiB (OLMoE, T=2048-16384 D=2048 F=768 E=128)
WGRAD_WIDE_TILE_EXPERT_BYTES = 12 * 1024**2


#: Bytes of one expert's weight gradient from which the Gluon WGRAD's 256 x 128 tiles run
#: with their producers in lockstep (:attr:`~distmoe.kernels.wgrad.config.WgradConfig.
#: lockstep`): an expert whose gradient outgrows the 50 MB L2 streams its own rows out of it
#: before the programs that lag behind read them. One H100 (docs/performance.md run 55):
#: DeepSeek-V3's W13 WGRAD (56 MiB an expert) alone 1.41x, its layer fwd+bwd 1.050x under
#: sampled routing with this one on (both WGRADs: 1.045x; 1.11x exact); at 28-32 MiB (its
#: W2, DeepSeek-V4-Flash, GPT-OSS-120B, T=8192 D=4096 F=2048 E=32) the layer 0.99-1.00x
#: under sampled routing.
WGRAD_LOCKSTEP_EXPERT_BYTES = 48 * 1024**2


#: Device memory from which a Hopper GPU counts as HBM3e-class for the WGRAD's tile rule
#: (:func:`wgrad_wide_tiles`): the H200's 141 GB (4.8 TB/s; torch reports 140.4 GiB) and
#: GH200's 144 GB, against the H100's 80 GB (3.35 TB/s; 79.6 GiB) on the same 132 SMs.
#: Memory size stands in for DRAM bandwidth, which torch does not report; parts between
#: (H20, H100 NVL: 94-96 GB, about 4 TB/s) are unmeasured and take the H100's rule.
HBM3E_MEMORY_BYTES = 120 * 1024**3

#: On an HBM3e-class device (:data:`HBM3E_MEMORY_BYTES`), the rows per expert (the shape
#: hint) from which the WGRAD's 256 x 128 tiles are taken; below, its ping-pong 128 x 128
#: tiles. One H200 (docs/performance.md run 57, layer fwd+bwd, 15 rounds): ping-pong faster
#: at 96-128 rows per expert (DeepSeek-V3 1.029x sampled / 1.035x exact, GPT-OSS-120B
#: 1.048x exact, DeepSeek-V4-Flash 1.025x sampled, even exact), the 256 x 128 tiles faster at
#: 2048 (T=8192 D=4096 F=2048 E=32: 1.028x over ping-pong; run 47: 16.29 against 16.42 ms
#: over the two cooperating warpgroups). 1024 is where the cooperating warpgroups begin;
#: between 128 and 2048 rows the line is not measured.
WGRAD_WIDE_TILE_ROWS_HBM3E = 1024


def wgrad_lockstep(*, out_rows: int, out_cols: int, rows_per_expert: int | None = None,
                   device_memory: int | None = None) -> bool:
    """Whether the Gluon WGRAD over a TMA-fed B (256 x 128 tiles) starts each wave of tiles
    together: it takes those tiles (:func:`wgrad_wide_tiles`, same arguments) and each
    expert's ``out_rows x out_cols`` bf16 gradient holds at least
    :data:`WGRAD_LOCKSTEP_EXPERT_BYTES`."""
    return (wgrad_wide_tiles(out_rows=out_rows, out_cols=out_cols,
                             rows_per_expert=rows_per_expert, device_memory=device_memory)
            and 2 * out_rows * out_cols >= WGRAD_LOCKSTEP_EXPERT_BYTES)


def wgrad_wide_tiles(*, out_rows: int, out_cols: int, rows_per_expert: int | None = None,
                     device_memory: int | None = None) -> bool:
    """Whether the Gluon WGRAD over a TMA-fed B takes 256 x 128 output tiles: each expert's
    ``out_rows x out_cols`` bf16 gradient at least :data:`WGRAD_WIDE_TILE_EXPERT_BYTES`, at
    least 256 rows and 128 columns; and on a device with ``device_memory`` bytes (``None``:
    not known) of at least :data:`HBM3E_MEMORY_BYTES`, a ``rows_per_expert`` hint (``None``:
    none given) of at least :data:`WGRAD_WIDE_TILE_ROWS_HBM3E`."""
    if not (out_rows >= 256 and out_cols >= 128
            and 2 * out_rows * out_cols >= WGRAD_WIDE_TILE_EXPERT_BYTES):
        return False
    if device_memory is None or device_memory < HBM3E_MEMORY_BYTES or rows_per_expert is None:
        return True
    return rows_per_expert >= WGRAD_WIDE_TILE_ROWS_HBM3E
