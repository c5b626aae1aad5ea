"""The forward GEMM configs: heuristic picks and the checks of every ``bool`` option.
"""

import pytest

from distmoe.kernels.movement.combine import CombineConfig
from distmoe.kernels.w2_forward.config import W2Config
from distmoe.kernels.w13_forward.config import W13Config
from distmoe.plan import rules


def test_configs():
    w13 = rules.w13_forward_config(hidden=4096, ffn=2048)
    assert (w13.block_m, w13.block_n, w13.block_k, w13.num_warps) == (128, 128, 64, 8)
    assert 3 <= w13.num_stages <= 4 and w13.fits_hopper()
    w2 = rules.w2_forward_config(hidden=4096, ffn=2048)
    assert (w2.block_m, w2.block_n, w2.block_k, w2.num_warps) == (128, 128, 64, 8)
    assert w2.fits_hopper()
    assert w13.host_descriptors and w2.host_descriptors and not (w13.persistent or w2.persistent)
    assert not w13.tma_epilogue
    # With the shape hint: persistent; 4 stages but for training with long expert segments
    # (hint >= 1024); the TMA epilogue only for inference with long segments.
    for hint, training, stages, tma in ((2048, False, 4, True), (2048, True, 3, False),
                                        (256, False, 4, False), (256, True, 4, False)):
        c = rules.w13_forward_config(hidden=4096, ffn=2048, rows_per_expert=hint,
                                     training=training)
        assert (c.persistent, c.num_stages, c.tma_epilogue) == (True, stages, tma)
        assert c.fits_hopper()
    with pytest.raises(TypeError, match="tma_epilogue must be a bool"):
        W13Config(tma_epilogue=1)
    for cls in (W13Config, W2Config):
        configs = cls.all_configs(block_m=128)
        assert configs and all(c.fits_hopper() and c.block_m == 128 for c in configs)
    assert CombineConfig.all_configs()
    # the combine: one token of 1024 columns, 8 warps (run 33); small D: 1024 elements
    assert rules.combine_config(hidden=2048) == CombineConfig(block_t=1, block_d=1024,
                                                                      num_warps=8)
    assert rules.combine_config(hidden=7168).block_d == 1024
    assert rules.combine_config(hidden=48) == CombineConfig(block_t=16, block_d=64,
                                                                    num_warps=4)
    with pytest.raises(ValueError, match=r"block_k \(48\) must be a power of two"):
        W13Config(block_k=48)
    with pytest.raises(ValueError, match=r"num_warps \(2\) must be 4 or 8"):
        W2Config(num_warps=2)
    with pytest.raises(TypeError):
        W2Config(128)  # keyword-only


def test_every_bool_option_of_the_gemm_configs_is_checked():
    """GemmConfig checks every field annotated ``bool``, a subclass's too (the four launch
    configs declare theirs only): an int there is a TypeError naming the field and the type.
    The options each config has are listed, so a new one cannot go unchecked unnoticed."""
    import dataclasses

    from distmoe.kernels.w2_dgrad.config import W2DgradConfig
    from distmoe.kernels.w13_dgrad.config import W13DgradConfig

    common = ["persistent", "host_descriptors"]
    expected = {W13Config: common + ["tma_epilogue", "gluon", "lockstep", "expert_groups"],
                W2Config: common + ["gluon", "lockstep", "expert_groups"],
                W2DgradConfig: common + ["gluon", "lockstep", "expert_groups"],
                W13DgradConfig: common + ["pair_tails", "dynamic", "gluon", "lockstep",
                                          "expert_groups"]}
    for cls, names in expected.items():
        assert [f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)] == names
        for name in names:
            with pytest.raises(TypeError, match=f"^{name} must be a bool, got int$"):
                cls(**{name: 1})
