"""tools/ab_bench.py: override parsing and the patched heuristics (the bench itself runs on a
GPU; its CPU path is covered by test_bench_cli)."""

import pytest

from distmoe.kernels.w2_dgrad.config import W2DgradConfig
from distmoe.kernels.w13_forward.config import W13Config


@pytest.fixture
def ab(load_tool):
    mod = load_tool("ab_bench")
    saved = {cls: cls.__dict__["from_heuristic"] for cls in (W13Config, W2DgradConfig)}
    yield mod
    for cls, method in saved.items():
        cls.from_heuristic = method


def test_parse_override(ab):
    assert ab.parse_override("w13:training:num_stages=4,tma_epilogue=True") == (
        "w13", "training", {"num_stages": 4, "tma_epilogue": True})
    assert ab.parse_override("w2_dgrad:group_m=16") == ("w2_dgrad", "any", {"group_m": 16})
    for bad, match in (("w14:num_stages=4", "kernel must be one of"),
                       ("w2:training:num_stages=4", "WHEN must be"),
                       ("w13:num_stages", "is not FIELD=VALUE"),
                       ("w13", "expected KERNEL")):
        with pytest.raises(ValueError, match=match):
            ab.parse_override(bad)


def test_install_applies_only_where_asked(ab):
    kw = dict(hidden=4096, ffn=2048, rows_per_expert=2048)
    plain_train = W13Config.from_heuristic(training=True, **kw)
    plain_inf = W13Config.from_heuristic(**kw)
    plain_dgrad = W2DgradConfig.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048)
    ab.install([ab.parse_override("w13:training:num_stages=2,group_m=16"),
                ab.parse_override("w2_dgrad:num_stages=2")])
    assert W13Config.from_heuristic(training=True, **kw) == W13Config(
        **{**vars(plain_train), "num_stages": 2, "group_m": 16})
    assert W13Config.from_heuristic(**kw) == plain_inf
    assert W2DgradConfig.from_heuristic(hidden=4096, ffn=2048, rows_per_expert=2048).num_stages == 2
    assert plain_dgrad.num_stages != 2
    with pytest.raises(ValueError, match="has no field"):
        ab.install([("w2", "any", {"stages": 3})])


def test_split_args_with_and_without_the_separator(ab):
    # torch.distributed.run drops a "--" right after the script: whatever ab_bench does not
    # know goes to the bench either way.
    bench = ["--mode", "fwd", "--shapes", "issue-a", "fine", "--seed", "3"]
    assert ab.split_args(["--", *bench]) == ([], bench)
    assert ab.split_args(bench) == ([], bench)
    sets = ["--set", "w2:num_stages=5", "--set", "w13:inference:gluon=False"]
    assert ab.split_args([*sets, "--", *bench]) == (
        ["w2:num_stages=5", "w13:inference:gluon=False"], bench)
    assert ab.split_args([*sets, *bench]) == (
        ["w2:num_stages=5", "w13:inference:gluon=False"], bench)
    # after "--" even a --set goes to the bench
    assert ab.split_args(["--", "--set", "x"]) == ([], ["--set", "x"])
