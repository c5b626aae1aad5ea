"""The backward configs' tuning candidates and heuristics, and the argument checks of every backward launcher.

Layouts, poisoning and tolerances: :mod:`backward_cases` (tests/kernels/backward_cases.py).
"""

from dataclasses import replace

import pytest
import torch
from backward_cases import DEVICE

from distmoe.kernels.movement.route_grad import RouteGradConfig, reduce_routes, route_grads
from distmoe.kernels.w2_dgrad.config import W2DgradConfig
from distmoe.kernels.w2_dgrad.triton import w2_dgrad_swiglu_bwd
from distmoe.kernels.w13_dgrad.config import W13DgradConfig
from distmoe.kernels.w13_dgrad.triton import w13_dgrad_scatter
from distmoe.kernels.wgrad.config import WgradConfig
from distmoe.kernels.wgrad.triton import w2_wgrad, w13_wgrad
from distmoe.plan import device_class, rules


def test_configs():
    for cfg in W2DgradConfig.all_configs(hidden=4096, ffn=2048):
        assert cfg.fits_hopper() and cfg.block_m == 128
    for cfg in W13DgradConfig.all_configs(hidden=7168, ffn=768, block_m=64):
        assert cfg.fits_hopper() and cfg.block_m == 64
    for cfg in WgradConfig.all_configs(out_rows=4096, out_cols=2048, block_m=64):
        assert cfg.fits_hopper() and 64 % cfg.block_k == 0
    assert RouteGradConfig.all_configs(hidden=40)
    big = rules.wgrad_config(out_rows=4096, out_cols=2048)
    assert (big.block_out_m, big.block_out_n, big.num_warps) == (128, 128, 8)
    assert rules.w2_dgrad_config(hidden=4096, ffn=2048).block_n == 128
    with pytest.raises(ValueError, match=r"block_k \(64\) must divide block_m \(32\)"):
        WgradConfig(block_m=32, block_k=64)
    # Persistent grids: accepted, swept, never the default (until measured on an H200).
    for cls, rule in ((W2DgradConfig, rules.w2_dgrad_config),
                      (W13DgradConfig, rules.w13_dgrad_config)):
        assert cls(persistent=True).persistent
        assert not rule(hidden=4096, ffn=2048).persistent
        swept = cls.all_configs(hidden=4096, ffn=2048)
        assert {c.persistent for c in swept} == {False, True}
        tiles = [replace(c, persistent=False) for c in swept if c.persistent]
        assert tiles and all(c in swept for c in tiles)  # a persistent twin of each tile grid
    # With the layer's shape hint (balanced rows per local expert): the tuned 128 x 256 tiles
    # when the dimension they split is wide enough, else the defaults above.
    w2d = rules.w2_dgrad_config(hidden=4096, ffn=2048, rows_per_expert=2048)
    assert (w2d.block_n, w2d.num_stages, w2d.persistent) == (256, 4, False)
    # the Gluon W2 DGRAD only where it runs (a Hopper GPU outside the interpreter)
    cpu = rules.w2_dgrad_config(hidden=4096, ffn=2048, rows_per_expert=2048,
                                       device_class=device_class(torch.device("cpu")))
    assert cpu == w2d and not cpu.gluon
    w13d = rules.w13_dgrad_config(hidden=2048, ffn=768, rows_per_expert=256)
    assert (w13d.block_n, w13d.num_stages, w13d.persistent) == (256, 4, True)
    assert w13d.dynamic and w13d.pair_tails  # run 40: the layer's tiles, handed out
    assert w2d.fits_hopper() and w13d.fits_hopper()
    for rule in (rules.w2_dgrad_config, rules.w13_dgrad_config):
        assert rule(hidden=128, ffn=128, rows_per_expert=2048) == rule(hidden=128, ffn=128)
        assert rule(hidden=4096, ffn=2048, block_m=64, rows_per_expert=2048) \
            == rule(hidden=4096, ffn=2048, block_m=64)


def test_validation_errors():
    ffn, hidden, rows = 16, 32, 32
    w2 = torch.zeros(2, hidden, ffn, dtype=torch.bfloat16, device=DEVICE)
    ptrs = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    row_offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    h1 = torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    cfg = W2DgradConfig(block_m=16, block_n=16, block_k=16, num_warps=4)
    with pytest.raises(TypeError, match=r"grad_h3_ptrs must have dtype int64, got torch.int32"):
        w2_dgrad_swiglu_bwd(ptrs.int(), offsets, row_offsets, w2, h1, h1.clone(), config=cfg)
    with pytest.raises(
        ValueError, match=r"h1 must have shape \[32, 32\] \[R_act, 2F\] like grad_h1_out"
    ):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, h1[:, :24], h1.clone(), config=cfg)
    with pytest.raises(ValueError, match=r"R_cap \(24\) must be a multiple of config.block_m"):
        w2_dgrad_swiglu_bwd(ptrs[:24], offsets, row_offsets, w2, h1, h1.clone(), config=cfg)
    scratch = torch.zeros(rows * 3 * ffn, dtype=torch.bfloat16, device=DEVICE)
    grad_h1 = scratch[: rows * 2 * ffn].view(rows, 2 * ffn)
    h2_overlapping = scratch[rows * ffn : rows * 2 * ffn].view(rows, ffn)
    with pytest.raises(ValueError, match=r"grad_h1_out and h2_out must not overlap in memory"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, h1, grad_h1, h2_out=h2_overlapping, config=cfg
        )
    shifted = torch.zeros((rows + 1) * 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"h1 and grad_h1_out must not overlap in memory"):
        w2_dgrad_swiglu_bwd(
            ptrs,
            offsets,
            row_offsets,
            w2,
            shifted[: rows * 2 * ffn].view(rows, 2 * ffn),
            shifted[2 * ffn :].view(rows, 2 * ffn),  # one row further: not the same rows
            config=cfg,
        )
    with pytest.raises(ValueError, match=r"padded_offsets must have shape \[3\]"):
        w2_dgrad_swiglu_bwd(ptrs, offsets[:2], row_offsets, w2, h1, h1.clone(), config=cfg)
    with pytest.raises(TypeError, match=r"config must be a W2DgradConfig"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, h1, h1.clone(), config=WgradConfig())
    with pytest.raises(ValueError, match=r"F \(w2.shape\[2\]\) \(12\) must be a positive multiple"):
        w2_dgrad_swiglu_bwd(
            ptrs,
            offsets,
            row_offsets,
            w2[..., :12].contiguous(),
            h1[:, :24].contiguous(),
            h1[:, :24].contiguous(),
            config=cfg,
        )
    grad_w2 = torch.zeros(2, hidden, ffn, device=DEVICE)
    grad_h3 = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match=r"grad_w2 must have dtype float32, got torch.bfloat16"):
        w2_wgrad(grad_h3, h1[:, :ffn], offsets, row_offsets, grad_w2.bfloat16())
    with pytest.raises(ValueError, match=r"h2 must be contiguous"):
        w2_wgrad(grad_h3, h1[:, :ffn], offsets, row_offsets, grad_w2)
    with pytest.raises(
        ValueError, match=r"h2 must have shape \[32, 16\] \[R_act, F\] like grad_h3, got \[16, 16\]"
    ):
        w2_wgrad(grad_h3, h1[:16, :ffn].contiguous(), offsets, row_offsets, grad_w2)
    w13 = torch.zeros(2, 2, ffn, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"w13 must have shape \[E_local, 2, F, D\]"):
        w13_dgrad_scatter(h1, offsets, row_offsets, w13.reshape(2, 4, ffn // 2, hidden), ptrs)
    with pytest.raises(ValueError, match=r"scores must have shape \[4, 2\]"):
        ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
        route_grads(
            torch.zeros(4, hidden, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(8, hidden, dtype=torch.bfloat16, device=DEVICE),
            ids,
            torch.zeros(4, 3, device=DEVICE),
            torch.zeros(8, hidden, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(4, 2, device=DEVICE),
        )
    with pytest.raises(ValueError, match=r"route_rows must have shape \[R, 32\] with R >= T\*K"):
        reduce_routes(
            torch.zeros(7, hidden, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(4, 2, dtype=torch.int64, device=DEVICE),
            torch.zeros(4, hidden, dtype=torch.bfloat16, device=DEVICE),
        )


def test_validation_errors_new_arguments():
    """row_offsets, h1_offset, x_offset and h3_addr: each rule named with its value."""
    ffn, hidden, rows = 16, 32, 32
    w2 = torch.zeros(2, hidden, ffn, dtype=torch.bfloat16, device=DEVICE)
    ptrs = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    row_offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    h1 = torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    base = torch.zeros(8 + rows * 2 * ffn, dtype=torch.bfloat16, device=DEVICE)
    off = torch.tensor([8], dtype=torch.int64, device=DEVICE)
    cfg = W2DgradConfig(block_m=16, block_n=16, block_k=16, num_warps=4)

    # row_offsets (every kernel that takes it)
    with pytest.raises(TypeError, match=r"row_offsets must have dtype int32, got torch.int64"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets.long(), w2, h1, h1.clone(), config=cfg)
    with pytest.raises(
        ValueError, match=r"row_offsets must have shape \[3\] \[E_local \+ 1\].*got \[2\]"
    ):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets[:2], w2, h1, h1.clone(), config=cfg)
    grad_w2 = torch.zeros(2, hidden, ffn, device=DEVICE)
    grad_h3 = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"row_offsets must have shape \[3\]"):
        w2_wgrad(grad_h3, h1[:, :ffn].contiguous(), offsets, row_offsets[:2], grad_w2)
    w13 = torch.zeros(2, 2, ffn, hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match=r"row_offsets must be a torch.Tensor, got list"):
        w13_dgrad_scatter(h1, offsets, [0, 0, 0], w13, ptrs)
    with pytest.raises(ValueError, match=r"grad_h1 must have shape \[R_act, 32\].*got \[32, 24\]"):
        w13_dgrad_scatter(h1[:, :24].contiguous(), offsets, row_offsets, w13, ptrs)

    # h1_offset
    with pytest.raises(TypeError, match=r"h1_offset must have dtype int64, got torch.int32"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base, h1, h1_offset=off.int(), config=cfg
        )
    with pytest.raises(ValueError, match=r"h1_offset must have shape \[1\].*got \[2\]"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base, h1, h1_offset=off.repeat(2), config=cfg
        )
    with pytest.raises(
        ValueError,
        match=r"h1 must be a 1-D bf16 base tensor when h1_offset is given .*got shape \[32, 32\]",
    ):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, h1, h1.clone(), h1_offset=off)
    with pytest.raises(TypeError, match=r"h1 must have dtype bfloat16, got torch.float32"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base.float(), h1, h1_offset=off, config=cfg
        )
    with pytest.raises(ValueError, match=r"h1 must start at a 16-byte aligned address"):
        w2_dgrad_swiglu_bwd(ptrs, offsets, row_offsets, w2, base[1:], h1, h1_offset=off, config=cfg)
    with pytest.raises(ValueError, match=r"h1_offset must be on the same device as grad_h3_ptrs"):
        w2_dgrad_swiglu_bwd(
            ptrs, offsets, row_offsets, w2, base, h1, h1_offset=off.to("meta"), config=cfg
        )
    # With h1_offset the base may hold the grad_h1 rows (in place: not checkable on the host).
    w2_dgrad_swiglu_bwd(
        ptrs,
        offsets,
        row_offsets,
        w2,
        base,
        base[8:].view(rows, 2 * ffn),
        h1_offset=off,
        config=cfg,
    )

    # x_offset
    grad_w13 = torch.zeros(2, 2, ffn, hidden, device=DEVICE)
    x_base = torch.zeros(8 + rows * hidden, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match=r"x_offset must have dtype int64, got torch.float32"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off.float())
    with pytest.raises(
        ValueError,
        match=r"x_gathered must be a 1-D bf16 base tensor when x_offset is given .*\[32, 32\]",
    ):
        w13_wgrad(h1, grad_h3, offsets, row_offsets, grad_w13, x_offset=off)
    with pytest.raises(ValueError, match=r"x_gathered must have shape \[32, 32\] \[R_act, D\]"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13)
    with pytest.raises(ValueError, match=r"x_gathered must start at a 16-byte aligned address"):
        w13_wgrad(h1, x_base[3:], offsets, row_offsets, grad_w13, x_offset=off)
    # x_rows (a row address table; checked before any launch)
    table = torch.zeros(64, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"x_rows needs x_offset .*got x_offset=None"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_rows=table)
    with pytest.raises(TypeError, match=r"x_rows must have dtype int64, got torch.int32"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off,
                  x_rows=table.int())
    with pytest.raises(ValueError, match=r"rows_origin must be a non-negative int, a multiple "
                                         r"of 16 .*got 8"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off, x_rows=table,
                  rows_origin=8)
    with pytest.raises(ValueError, match=r"x_offset must have shape \[2\] \[2\] with x_rows"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off, x_rows=table,
                  rows_origin=16)
    with pytest.raises(ValueError, match=r"rows_origin is read only with x_rows, got 16"):
        w13_wgrad(h1, x_base, offsets, row_offsets, grad_w13, x_offset=off, rows_origin=16)

    # h3_addr
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    grad_y = torch.zeros(4, hidden, dtype=torch.bfloat16, device=DEVICE)
    scores = torch.zeros(4, 2, device=DEVICE)
    routes = torch.zeros(8, hidden, dtype=torch.bfloat16, device=DEVICE)
    grad_scores = torch.zeros(4, 2, device=DEVICE)
    addr = torch.tensor([routes.data_ptr()], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"h3_routes must be None when h3_addr is given"):
        route_grads(grad_y, routes, ids, scores, routes.clone(), grad_scores, h3_addr=addr)
    with pytest.raises(TypeError, match=r"h3_routes must be a torch.Tensor when h3_addr is not"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores)
    with pytest.raises(TypeError, match=r"h3_addr must have dtype int64, got torch.int32"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores, h3_addr=addr.int())
    with pytest.raises(ValueError, match=r"h3_addr must have shape \[1\].*got \[1, 1\]"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores, h3_addr=addr[None])
    with pytest.raises(ValueError, match=r"h3_addr must be on the same device as grad_y"):
        route_grads(grad_y, None, ids, scores, routes, grad_scores, h3_addr=addr.to("meta"))
    with pytest.raises(
        ValueError, match=r"h3_routes and grad_routes_out must be disjoint or start at the same row"
    ):
        nine = torch.zeros(9, hidden, dtype=torch.bfloat16, device=DEVICE)
        route_grads(grad_y, nine[1:], ids, scores, nine[:-1], grad_scores)  # one row apart
