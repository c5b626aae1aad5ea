"""MXFP4 inference forward (``MoEConfig(precision="mxfp4", training=False)``: GPT-OSS's expert
format, E2M1 weights with E8M0 scales per 32, bf16 activations) on CPU ranks (Triton's
interpreter), EP 1 and 2, against the bf16 layer in float64 on the *dequantised* weights
(``distmoe.reference.moe_reference``).

Bound: the weights decode exactly in bf16 (a 2-bit significand times a power of two), so the
layer differs from that reference only by its roundings: each GEMM's fp32 summation (relative
~K 2^-24 of the sum of |products|), h2's and h3's bf16 roundings (2^-8 relative each, h2's
carried through W2 by at most the sum over F of |h2| |w2|) and the combine's (fp32, then bf16:
2^-8). With these random inputs that is well inside 2^-6 of the largest output; a wrong
scale, nibble order or row gives O(1) errors. D = 96 and F = 64 put a partial K tile of 64 in
W13. Also: prepare_weights' MXFP4 weights refused by an NVFP4 context and raw weights refused
with a message naming prepare_weights."""

from __future__ import annotations

import pytest
import torch

import distmoe as dm
from distmoe.quant import prepare_weights
from distmoe.reference import moe_reference, random_routing, split_global_problem

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

D, F, E, T, K = 96, 64, 4, 12, 2
TOL = 2.0**-6


def _problem(world):
    g = torch.Generator().manual_seed(59 + world)
    x = torch.randn(world * T, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    ids, scores = random_routing(world * T, E, K, generator=g, inactive_fraction=0.15)
    return x, ids, scores.float(), w13, w2


def _rank(rank, world):
    x, ids, scores, w13, w2 = _problem(world)
    mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
    w13p, w2p = prepare_weights(mine.w13, mine.w2, "mxfp4")
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                       precision="mxfp4", training=False, row_block=16,
                       device_scratch_factor=float(world))
    out = {}
    with dm.MoEContext(cfg, device=torch.device("cpu"), check=True) as ctx:
        out["y"] = ctx(mine.x, mine.expert_ids, mine.scores, w13p, w2p)
        try:
            ctx(mine.x, mine.expert_ids, mine.scores, mine.w13, w2p)
        except TypeError as exc:
            out["raw"] = str(exc)
    out["w13"], out["w2"] = w13p.dequantize(torch.float64), w2p.dequantize(torch.float64)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_mxfp4_forward_against_float64(world):
    per_rank = dm.launch(_rank, world, timeout=300)
    x, ids, scores, _, _ = _problem(world)
    w13 = torch.cat([r["w13"] for r in per_rank])
    w2 = torch.cat([r["w2"] for r in per_rank])
    ref = moe_reference(x.double(), ids, scores.double(), w13, w2)
    y = torch.cat([r["y"] for r in per_rank]).double()
    scale = ref.abs().max().item()
    err = (y - ref).abs().max().item()
    assert err <= TOL * scale, f"{err:.3g} from the reference (bound {TOL} x {scale:.3g})"
    assert "prepare_weights" in per_rank[0]["raw"], per_rank[0]["raw"]


def test_mxfp4_config_rules():
    with pytest.raises(ValueError, match="precision 'mxfp4' is inference only"):
        dm.MoEConfig(hidden=64, ffn=64, num_experts=2, top_k=1, max_tokens=4,
                     precision="mxfp4", training=True)
    with pytest.raises(ValueError, match=r"hidden \(48\) must be a multiple of 32 for "
                                         r"precision 'mxfp4'"):
        dm.MoEConfig(hidden=48, ffn=64, num_experts=2, top_k=1, max_tokens=4,
                     precision="mxfp4", training=False)
