"""Benchmark work models against numbers computed by hand (products written out in comments)."""

import math

import pytest

from distmoe.tools.bench import models


def test_useful_flops_forward_backward_training():
    # qwen3-30b-a3b: T4096 D2048 F768 K8 -> 6 * 4096 * 8 * 2048 * 768 = 6 * 32768 * 1572864
    fwd = 309_237_645_312
    kw = {"tokens": 4096, "hidden": 2048, "ffn": 768, "top_k": 8}
    assert models.useful_flops(**kw, mode="fwd") == fwd
    assert models.useful_flops(**kw, mode="bwd") == 2 * fwd == 618_475_290_624
    assert models.useful_flops(**kw, mode="fwdbwd") == 927_712_935_936


def test_useful_flops_rejects_bad_mode_and_sizes():
    with pytest.raises(ValueError, match="mode"):
        models.useful_flops(tokens=1, hidden=8, ffn=8, top_k=1, mode="train")
    with pytest.raises(ValueError, match="tokens"):
        models.useful_flops(tokens=0, hidden=8, ffn=8, top_k=1)


def test_forward_hbm_bytes_per_tensor_small():
    # T=2 D=8 F=4 K=2 E_local=3 -> R=4
    b = models.forward_hbm_bytes(tokens=2, hidden=8, ffn=4, top_k=2, num_local_experts=3)
    assert b.x == 32  # 2 B * 2 * 8
    assert b.expert_ids == 16  # int32: 4 B * 2 * 2
    assert b.scores == 16  # fp32: 4 B * 2 * 2
    assert b.weights == 576  # 2 B * 3 experts * (2F*D + D*F) = 2 * 3 * 96
    assert b.routed_rows == 64  # 2 B * 4 * 8
    assert b.h1 == 64  # 2 B * 4 * 8 (2F)
    assert b.h2 == 32  # 2 B * 4 * 4
    assert b.h3 == 64  # 2 B * 4 * 8
    assert b.y == 32
    assert b.total == 896


def test_modeled_hbm_bytes_modes_rows_and_precision():
    kw = {"tokens": 2, "hidden": 8, "ffn": 4, "top_k": 2, "num_local_experts": 3}
    assert models.modeled_hbm_bytes(**kw, mode="fwd") == 896
    assert models.modeled_hbm_bytes(**kw, mode="bwd") == 1792
    assert models.modeled_hbm_bytes(**kw, mode="fwdbwd") == 2688
    # rows=10 instead of 4: routed 160, h1 160, h2 80, h3 160 -> 896 - 224 + 560
    assert models.modeled_hbm_bytes(**kw, rows=10) == 1232
    # mxfp8: weights 1.03125 * 288 = 297, routed rows 1.03125 * 32 = 33 -> 896 - 576 - 64 + 330
    assert models.modeled_hbm_bytes(**kw, precision="mxfp8") == pytest.approx(586)
    with pytest.raises(ValueError, match="precision"):
        models.modeled_hbm_bytes(**kw, precision="fp16")
    # one of the three local experts routed to: its weights only, 576 / 3 = 192
    assert models.modeled_hbm_bytes(**kw, active_experts=1) == 896 - 384
    assert models.modeled_hbm_bytes(**kw, active_experts=3) == 896
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="active_experts"):
            models.modeled_hbm_bytes(**kw, active_experts=bad)


def test_hbm_bytes_issue_a_shape():
    # dense-e32: T8192 D4096 F2048 K8 E32, R = 65536
    b = models.forward_hbm_bytes(tokens=8192, hidden=4096, ffn=2048, top_k=8, num_local_experts=32)
    assert b.x == b.y == 67_108_864
    assert b.weights == 1_610_612_736  # 2 * 32 * 3 * 4096 * 2048
    assert b.routed_rows == b.h1 == b.h3 == 536_870_912
    assert b.h2 == 268_435_456
    assert b.total == 3_624_402_944


def test_nvlink_bytes():
    kw = {"tokens": 4096, "hidden": 2048, "top_k": 8}
    # EP=4: 3/4 of 32768 routes = 24576 remote rows of 4096 B each way
    fwd = models.nvlink_bytes(**kw, ep_size=4, mode="fwd")
    assert fwd.dispatch == fwd.combine == 100_663_296
    assert fwd.total == 201_326_592
    assert models.nvlink_bytes(**kw, ep_size=4, mode="bwd").total == 201_326_592
    assert models.nvlink_bytes(**kw, ep_size=4, mode="fwdbwd").total == 402_653_184
    assert models.nvlink_bytes(**kw, ep_size=1, mode="fwdbwd").total == 0
    # mxfp8 forward: dispatch 24576 * 2048 * 1.03125, combine stays bf16
    q = models.nvlink_bytes(**kw, ep_size=4, mode="fwd", precision="mxfp8")
    assert q.dispatch == 51_904_512
    assert q.combine == 100_663_296


def test_projection_intensity_and_balance_point():
    # eq. 90, M=128, d_in=d_out=4096: 2*128*4096^2 / (2*(2*128*4096 + 4096^2)) = 2048/17
    assert models.projection_intensity(128, 4096, 4096) == pytest.approx(2048 / 17)
    # M << d: close to M
    assert models.projection_intensity(4, 8192, 8192) == pytest.approx(4, rel=1e-3)
    assert models.balance_point(1e15, 5e12) == 200.0
    # eq. 89: I = 100 FLOP/B below the balance point -> I*B = 5e14
    assert models.roofline_rate(1e12, 1e10, peak_flops=1e15, bytes_per_s=5e12) == 5e14
    assert models.roofline_rate(1e12, 1e8, peak_flops=1e15, bytes_per_s=5e12) == 1e15


def test_gemm_pair_flops_and_bytes():
    # eqs. 92-93 with T=1024 K=4 N=64 d=h=4096
    dense = models.dense_gemm_pair(tokens=1024, top_k=4, d=4096, h=4096)
    moe = models.moe_gemm_pair(tokens=1024, top_k=4, num_experts=64, d=4096, h=4096)
    for pair in (dense, moe):
        assert pair.up_flops == 274_877_906_944  # 4 * 1024 * 4 * 4096^2
        assert pair.down_flops == 137_438_953_472
    # dense up 2*(T d + 2 K d h + 2 T K h) = 2*(4194304 + 134217728 + 33554432)
    assert dense.up_bytes == 343_932_928
    # dense down 2*(T K h + K h d + T d) = 2*(16777216 + 67108864 + 4194304)
    assert dense.down_bytes == 176_160_768
    # moe up 2*(T K d + 2 N d h + 2 T K h) = 2*(16777216 + 2147483648 + 33554432)
    assert moe.up_bytes == 4_395_630_592
    # moe down 2*(T K h + N h d + T K d) = 2*(16777216 + 1073741824 + 16777216)
    assert moe.down_bytes == 2_214_592_512


def test_modeled_rate_eq94():
    c, b = 1e15, 5e12
    dense = models.dense_gemm_pair(tokens=1024, top_k=4, d=4096, h=4096)
    moe = models.moe_gemm_pair(tokens=1024, top_k=4, num_experts=64, d=4096, h=4096)
    # dense: both GEMMs compute-bound (2.749e-4 s > 6.88e-5 s; 1.374e-4 s > 3.52e-5 s)
    assert dense.modeled_time(peak_flops=c, bytes_per_s=b) == pytest.approx(4.12316860416e-4)
    assert dense.modeled_rate(peak_flops=c, bytes_per_s=b) == pytest.approx(c)
    # moe: both memory-bound: 4395630592/5e12 + 2214592512/5e12 = 8.791261184e-4 + 4.429185024e-4
    assert moe.modeled_time(peak_flops=c, bytes_per_s=b) == pytest.approx(1.3220446208e-3)
    assert moe.modeled_rate(peak_flops=c, bytes_per_s=b) / c == pytest.approx(
        4.12316860416e-4 / 1.3220446208e-3
    )


def test_roofline_curve_monotone_and_bounded():
    pts = models.roofline_curve(
        [2**i for i in range(17)],
        top_k=4,
        num_experts=64,
        d=4096,
        h=4096,
        peak_flops=1e15,
        bytes_per_s=5e12,
    )
    assert [p.tokens for p in pts] == [2**i for i in range(17)]
    for p in pts:
        assert 0 < p.moe_fraction <= p.dense_fraction <= 1.0
    assert all(a.moe_fraction <= b.moe_fraction for a, b in zip(pts, pts[1:], strict=False))
    assert pts[-1].moe_fraction == pytest.approx(1.0)  # large T reaches the compute ceiling


def test_per_second():
    assert models.per_second(1e12, 2.0) == 5e14
    assert math.isnan(models.per_second(1.0, 0.0))
