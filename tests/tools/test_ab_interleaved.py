"""tools/ab_interleaved.py: variant parsing, configs applied to a layer's attributes, per-round
ratios; distmoe.tools.bench.layer_step's argument checks (the layer runs on a GPU)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distmoe.kernels.movement.combine import CombineConfig
from distmoe.kernels.w2_dgrad.config import W2DgradConfig
from distmoe.kernels.w2_forward.config import W2Config
from distmoe.kernels.w13_forward.config import W13Config
from distmoe.kernels.wgrad.config import WgradConfig
from distmoe.tools.bench.layer_step import Joined, layer_step

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ab_interleaved.py"


@pytest.fixture
def abi(load_tool):
    yield load_tool("ab_interleaved")
    sys.modules.pop("ab_bench", None)


def _ctx(training):
    w13 = W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                    group_m=8, persistent=True)
    w2 = W2Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8,
                  persistent=True)
    ctx = SimpleNamespace(_w13_cfg=w13, _w2_cfg=w2,
                          _combine_cfg=CombineConfig.from_heuristic(hidden=256))
    if training:
        ctx._w2_dgrad_cfg = W2DgradConfig(block_m=128, block_n=128, block_k=64, num_stages=4)
    return ctx


def test_ignored_changes_names_gluon_only_fields_on_triton_configs(abi):
    """A Gluon-only field (``lockstep``, ``expert_groups``) set on a config that runs the
    Triton kernel is named (run 59 timed such a variant against its own base); on a Gluon
    config, or any other field, nothing is."""
    ctx = _ctx(training=False)  # both configs Triton (gluon=False)
    base = abi.variant_configs(ctx, [], training=False)
    out = abi.variant_configs(ctx, ["w2:expert_groups=True", "w13:group_m=16"], training=False)
    assert abi.ignored_changes(base, out) == ["_w2_cfg.expert_groups"]
    out = abi.variant_configs(ctx, ["w13:lockstep=True,expert_groups=True"], training=False)
    assert abi.ignored_changes(base, out) == ["_w13_cfg.lockstep", "_w13_cfg.expert_groups"]
    ctx._w2_cfg = W2Config(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                           group_m=8, persistent=True, gluon=True)
    base = abi.variant_configs(ctx, [], training=False)
    out = abi.variant_configs(ctx, ["w2:expert_groups=True"], training=False)
    assert abi.ignored_changes(base, out) == []
    assert abi.ignored_changes(base, base) == []


def test_parse_variant(abi):
    assert abi.parse_variant("g16=w13:group_m=16+w2:gluon=False") == (
        "g16", ["w13:group_m=16", "w2:gluon=False"])
    for bad in ("g16", "=w13:group_m=16", "g16=", "base=w13:group_m=16",
                "replay=w13:group_m=16", "ep1share=w2:num_stages=3",
                "regather=w13:group_m=16"):
        with pytest.raises(ValueError, match="NAME=SPEC"):
            abi.parse_variant(bad)


def test_variant_configs_apply_to_the_layer_attributes(abi):
    ctx = _ctx(training=False)
    base = abi.variant_configs(ctx, [], training=False)
    assert base == {"_w13_cfg": ctx._w13_cfg, "_w2_cfg": ctx._w2_cfg,
                    "_combine_cfg": ctx._combine_cfg, abi.INPUT_BUFFER: False}
    out = abi.variant_configs(ctx, ["w13:inference:group_m=16", "w2:num_stages=3",
                                    "w13:training:num_stages=3"], training=False)
    assert out["_w13_cfg"].group_m == 16 and out["_w13_cfg"].num_stages == 4
    assert out["_w2_cfg"].num_stages == 3
    # the layer itself is untouched until a variant runs
    assert ctx._w13_cfg.group_m == 8 and ctx._w2_cfg.num_stages == 4
    with pytest.raises(ValueError, match="has no field"):
        abi.variant_configs(ctx, ["w2:stages=3"], training=False)
    with pytest.raises(ValueError, match="does not run w2_dgrad"):
        abi.variant_configs(ctx, ["w2_dgrad:num_stages=5"], training=False)
    train = _ctx(training=True)
    assert abi.variant_configs(train, ["w2_dgrad:num_stages=5"],
                               training=True)["_w2_dgrad_cfg"].num_stages == 5
    with pytest.raises(ValueError, match="score parts"):
        abi.variant_configs(train, ["w2_dgrad:block_n=256"], training=True)
    # one WGRAD, or both
    train._w2_wgrad_cfg = WgradConfig(num_stages=3)
    train._w13_wgrad_cfg = WgradConfig(num_stages=3)
    out = abi.variant_configs(train, ["w2_wgrad:num_stages=4"], training=True)
    assert (out["_w2_wgrad_cfg"].num_stages, out["_w13_wgrad_cfg"].num_stages) == (4, 3)
    out = abi.variant_configs(train, ["w13_wgrad:num_stages=5"], training=True)
    assert (out["_w2_wgrad_cfg"].num_stages, out["_w13_wgrad_cfg"].num_stages) == (3, 5)
    out = abi.variant_configs(train, ["wgrad:num_stages=4"], training=True)
    assert (out["_w2_wgrad_cfg"].num_stages, out["_w13_wgrad_cfg"].num_stages) == (4, 4)
    with pytest.raises(ValueError, match="does not run wgrad"):
        abi.variant_configs(ctx, ["w2_wgrad:num_stages=4"], training=False)
    # the owner combine's config
    out = abi.variant_configs(ctx, ["combine:block_t=4,num_warps=4"], training=False)
    assert (out["_combine_cfg"].block_t, out["_combine_cfg"].num_warps) == (4, 4)
    assert out["_combine_cfg"].block_d == ctx._combine_cfg.block_d
    # layer switches
    ctx._pull_all = True
    out = abi.variant_configs(ctx, ["layer:pull_all=False"], training=False)
    assert out["_pull_all"] is False and ctx._pull_all is True
    assert abi.variant_configs(ctx, [], training=False)["_pull_all"] is True
    out = abi.variant_configs(ctx, ["layer:w13_phases=False", "layer:w13_waves=3"],
                              training=False)
    assert out["_w13_phases"] is False and out["_w13_phase_waves"] == 3
    for bad in ("layer:pull_all=0", "layer:pull=False", "layer:pull_all", "layer:w13_waves=0",
                "layer:w13_waves=True", "layer:w13_phases=2"):
        with pytest.raises(ValueError, match="layer:NAME=True"):
            abi.variant_configs(ctx, [bad], training=False)
    # x in the context's input buffer: a switch of the step, inference only
    assert abi.variant_configs(ctx, ["input:buffer=True"], training=False)[abi.INPUT_BUFFER]
    for bad in ("input:buffer", "input:buffer=1", "input:x=True"):
        with pytest.raises(ValueError, match=r"expected input:buffer=True\|False"):
            abi.variant_configs(ctx, [bad], training=False)
    with pytest.raises(ValueError, match="inference"):
        abi.variant_configs(train, ["input:buffer=True"], training=True)


def test_round_ratios(abi):
    assert abi.round_ratios([2.0, 3.0], [1.0, 3.0]) == [2.0, 1.0]
    with pytest.raises(ValueError):
        abi.round_ratios([1.0], [1.0, 2.0])


def test_layer_step_checks_its_arguments_first():
    joined = Joined(None, 0, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="mode must be"):
        layer_step("issue-a", "bwd", joined)
    with pytest.raises(ValueError, match=r"tokens must be >= 1, got 0"):
        layer_step("issue-a", "fwd", joined, tokens=0)
    with pytest.raises(ValueError, match=r"routing must be one of \('exact', 'sampled'\), "
                       r"got 'uniform'"):
        layer_step("issue-a", "fwd", joined, routing="uniform")
    with pytest.raises(ValueError, match=r"EP \(3\) must divide the experts of issue-a \(32\)"):
        layer_step("issue-a", "fwd", joined)


def _run_tool(tmp_path, args, nproc=None):
    """The tool in a subprocess on the CPU (Triton interpreter), under
    ``torch.distributed.run`` with ``nproc`` ranks, or alone."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    launch = ([] if nproc is None else
              ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"])
    return subprocess.run([sys.executable, *launch, str(TOOL), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_two_cpu_ranks_with_the_ep1_share(tmp_path):
    """The whole tool under torch.distributed.run: two gloo ranks on the CPU (kernels in the
    Triton interpreter), the smoke shape at 48 tokens, a variant and the EP=1 share in the
    same rounds."""
    out = _run_tool(tmp_path, ["--shape", "smoke", "--tokens", "48", "--mode", "fwd",
                               "--rounds", "2", "--iters", "1", "--warmup", "1", "--ep1-share",
                               "--variant", "s3=w13:num_stages=3",
                               "--variant", "inbuf=input:buffer=True", "--routing", "exact"],
                    nproc=2)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("smoke fwd T=48 EP=2, CPU") for line in lines)
    assert any("s3: _w13_cfg=W13Config(" in line and "num_stages=3" in line for line in lines)
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and " x" in line}
    assert any("inbuf: input:buffer=True" in line for line in lines)
    assert set(rows) >= {"base", "s3", "inbuf", "ep1share"}
    assert "x1.0000" in rows["base"] and "EP=2 / EP=1 share:" in rows["ep1share"]
    assert "/ EP=1 share:" in rows["base"] and "/ EP=1 share:" in rows["inbuf"]


def test_replay_row_times_the_same_layer_replayed(tmp_path):
    """``--replay``: a second layer whose slot holds its input only (activation_factor 0),
    so its backward replays the forward, timed in the same rounds as the saved layer;
    ``--regather``: a third whose saved layers keep their input instead of their rows, with
    ``--regather-in-place both`` a fourth that reads those rows in place instead of copying."""
    out = _run_tool(tmp_path, ["--shape", "smoke", "--tokens", "48", "--mode", "fwdbwd",
                               "--rounds", "2", "--iters", "1", "--warmup", "1", "--replay",
                               "--regather", "--regather-in-place", "both", "--routing",
                               "exact"], nproc=1)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    caps = {}
    for line in lines:
        if " layer: activation buffer " in line:
            name, rest = line.split(" layer: ")
            caps[name.strip()] = int(rest.split("slot capacity ")[1].split()[0])
    assert set(caps) == {"base", "replay", "regather", "inplace"}
    assert 0 < caps["replay"] < caps["regather"] < caps["base"]  # EP = 1: T rows, not T*K
    assert caps["inplace"] == caps["regather"]
    assert any("(activation_factor 0.0, save_gathered_rows True, rows in place False)" in line
               for line in lines)
    assert any("regather layer:" in line and "save_gathered_rows False, rows in place False"
               in line for line in lines)
    assert any("inplace layer:" in line and "save_gathered_rows False, rows in place True"
               in line for line in lines)
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and " x" in line}
    assert set(rows) == {"base", "replay", "regather", "inplace"}
    assert "replayed / saved:" in rows["replay"]
    assert "regathered / saved:" in rows["regather"] and "regathered / saved:" in rows["inplace"]


def test_replay_needs_the_backward(tmp_path):
    out = _run_tool(tmp_path, ["--shape", "smoke", "--mode", "fwd", "--replay"])
    assert out.returncode == 2
    assert "--replay needs --mode fwdbwd" in out.stderr
