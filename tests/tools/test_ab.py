"""``python -m distmoe ab`` (:mod:`distmoe.tools.ab`): variant specs to overrides (unknown
kernels, fields and switches refused with the name), the option rules, the notes and ratios,
and whole runs on the CPU (Triton interpreter, the smoke shape): a variant and the EP=1 share
on two ranks, the replay and regather rows beside a training layer."""

import argparse
import json

import pytest

import distmoe as dm
from distmoe.plan import plan_kernels
from distmoe.tools import ab


def _args(*argv):
    return ab.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_parse_value():
    assert ab.parse_value("True") is True and ab.parse_value("False") is False
    assert ab.parse_value("None") is None
    assert ab.parse_value("4") == 4 and ab.parse_value("1x2x3") == (1, 2, 3)
    with pytest.raises(ValueError, match="is not a VALUE"):
        ab.parse_value("abc")


def test_specs_become_overrides():
    overrides, x_in_buffer = ab.overrides_from_specs(
        ["w13:num_stages=4,tma_epilogue=True", "w2_dgrad:group_m=16",
         "layer:pull_all=False,w13_phase_waves=3", "layer:pull_all=None", "w13:group_m=16"])
    assert overrides == {"w13": {"num_stages": 4, "tma_epilogue": True, "group_m": 16},
                         "w2_dgrad": {"group_m": 16},
                         "layer": {"pull_all": None, "w13_phase_waves": 3}}
    assert x_in_buffer is False
    # wgrad: both WGRADs; w2_wgrad / w13_wgrad: one
    assert ab.overrides_from_specs(["wgrad:num_stages=4", "w13_wgrad:num_stages=5"])[0] == {
        "w2_wgrad": {"num_stages": 4}, "w13_wgrad": {"num_stages": 5}}
    assert ab.overrides_from_specs(["input:buffer=True"]) == ({}, True)
    assert ab.overrides_from_specs(["combine:block_t=4,num_warps=4"])[0] == {
        "combine": {"block_t": 4, "num_warps": 4}}


@pytest.mark.parametrize("spec,message", [
    ("w13:nofield=3", "unknown field(s) nofield of W13Config (w13)"),
    ("wgrad:stages=3", "unknown field(s) stages of WgradConfig (wgrad)"),
    ("w14:num_stages=4", "unknown kernel 'w14'"),
    ("layer:pull=False", "unknown layer switch 'pull'"),
    ("layer:w2_beside=True", "unknown layer switch 'w2_beside'"),  # removed (measured slower)
    ("layer:pull_all=0", "layer switch pull_all must be bool or None, got 0"),
    ("layer:mega_lag=True", "layer switch mega_lag must be int, got True"),
    ("w13:training:num_stages=4", "expected KERNEL:FIELD=VALUE"),
    ("w13", "expected KERNEL:FIELD=VALUE"),
    ("w13:num_stages", "'num_stages' is not FIELD=VALUE"),
    ("w13:num_stages=abc", "num_stages='abc': 'abc' is not a VALUE"),
    ("input:buffer=1", "expected input:buffer=True|False"),
    ("input:x=True", "expected input:buffer=True|False"),
])
def test_bad_specs_are_refused_naming_what(spec, message):
    with pytest.raises(ValueError) as exc:
        ab.overrides_from_specs([spec])
    assert message in str(exc.value) and repr(spec) in str(exc.value)


def test_parse_variant():
    assert ab.parse_variant("g16=w13:group_m=16+w2:gluon=False") == (
        "g16", ["w13:group_m=16", "w2:gluon=False"])
    for bad in ("g16", "=w13:group_m=16", "g16=", "base=w13:group_m=16",
                "replay=w13:group_m=16", "ep1share=w2:num_stages=3",
                "regather=w13:group_m=16", "inplace=w13:group_m=16"):
        with pytest.raises(ValueError, match="NAME=SPEC"):
            ab.parse_variant(bad)


def test_ignored_changes_names_gluon_only_fields_on_triton_configs():
    """A Gluon-only field (``lockstep``, ``expert_groups``) set on a config that runs the
    Triton kernel is named (run 59 timed such a variant against its own base); on a Gluon
    config, or any other field, nothing is."""
    cfg = dm.MoEConfig(hidden=2048, ffn=768, num_experts=128, top_k=8, max_tokens=4096)
    base = plan_kernels(cfg, device_class="generic")  # every config Triton
    out = plan_kernels(cfg, device_class="generic", overrides=ab.overrides_from_specs(
        ["w2:expert_groups=True", "w13:group_m=16"])[0])
    assert ab.ignored_changes(base, out) == ["w2.expert_groups"]
    out = plan_kernels(cfg, device_class="generic", overrides=ab.overrides_from_specs(
        ["w13:lockstep=True,expert_groups=True"])[0])
    assert ab.ignored_changes(base, out) == ["w13.lockstep", "w13.expert_groups"]
    hopper = plan_kernels(cfg, device_class="h100")
    assert hopper.w2.gluon
    out = plan_kernels(cfg, device_class="h100",
                       overrides={"w2": {"expert_groups": not hopper.w2.expert_groups}})
    assert ab.ignored_changes(hopper, out) == [] and ab.ignored_changes(base, base) == []


def test_round_ratios():
    assert ab.round_ratios([2.0, 3.0], [1.0, 3.0]) == [2.0, 1.0]
    with pytest.raises(ValueError):
        ab.round_ratios([1.0], [1.0, 2.0])


def test_variants_the_plan_refuses_name_the_variant():
    """Checked against the layer's plan before inputs are drawn: a backward kernel in a
    forward run, gluon=True where no Gluon kernel runs, Mega in training or at EP=1."""
    with pytest.raises(ValueError, match=r"--variant d: overrides\['w2_dgrad'\]: the w2_dgrad "
                                         r"kernel runs in training only"):
        ab.check_variants("smoke", "fwd", None, 1, "cpu", {"d": {"w2_dgrad": {"num_stages": 3}}})
    with pytest.raises(ValueError, match=r"--variant g: .*gluon=True needs a Hopper"):
        ab.check_variants("smoke", "fwd", None, 1, "cpu", {"g": {"w13": {"gluon": True}}})
    with pytest.raises(ValueError, match=r"--variant m: .*Mega runs in EP > 1 inference"):
        ab.check_variants("smoke", "fwdbwd", None, 2, "cpu", {"m": {"layer": {"mega": True}}})
    ab.check_variants("smoke", "fwdbwd", 16, 1, "cpu", {"ok": {"w2_dgrad": {"num_stages": 3}}})


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "0"], "--rounds (0) must be >= 1"),
    (["--warmup", "-1"], "--warmup (-1) must be >= 0"),
    (["--tokens", "0"], "--tokens (0) must be >= 1"),
    (["--replay"], "--replay needs --mode fwdbwd"),
    (["--regather"], "--regather needs --mode fwdbwd"),
    (["--variant", "a=w13:group_m=8", "--variant", "a=w2:num_stages=3"],
     "--variant a: the name is given twice"),
    (["--variant", "a=w13:bogus=1"], "--variant a: 'w13:bogus=1': unknown field(s) bogus"),
    (["--mode", "fwdbwd", "--variant", "a=input:buffer=True"],
     "--variant a: input:buffer=True is for inference"),
    (["--budget", "--variant", "a=w13:group_m=8", "--replay"],
     "--variant, --replay: not with --budget"),
])
def test_option_rules(argv, message, capsys):
    with pytest.raises(ValueError) as exc:
        ab.check_arguments(_args(*argv))
    assert message in str(exc.value)
    assert ab.run(_args(*argv)) == 2  # before any group is joined
    err = capsys.readouterr().err
    assert err.startswith("distmoe ab: error: ") and message in err and err.count("\n") == 1


def test_defaults_depend_on_budget():
    args = _args()
    assert ab.check_arguments(args) == {}
    assert (args.shape, args.rounds, args.iters, args.warmup) == ("dense-e32", 15, 10, 3)
    args = _args("--budget")
    ab.check_arguments(args)
    assert (args.shape, args.rounds, args.iters, args.warmup) == ("qwen3-30b-a3b", 7, 3, 2)
    variants = ab.check_arguments(_args("--variant", "v=w13:group_m=16+input:buffer=True"))
    assert variants == {"v": ab.Variant(("w13:group_m=16", "input:buffer=True"),
                                        {"w13": {"group_m": 16}}, True)}


def test_two_cpu_ranks_with_the_ep1_share(tmp_path, distmoe_cli):
    """The whole command under torch.distributed.run: two gloo ranks on the CPU (kernels in
    the Triton interpreter), the smoke shape at 48 tokens, two variants (one the plan's
    layer switch, one x in the input buffer) and the EP=1 share in the same rounds; each
    context's plan printed first; the JSON written."""
    out = tmp_path / "ab.json"
    r = distmoe_cli("ab", "--shape", "smoke", "--tokens", "48", "--mode", "fwd", "--rounds",
                    "2", "--iters", "1", "--warmup", "1", "--ep1-share", "--variant",
                    "s3=w13:num_stages=3+layer:pull_all=False", "--variant",
                    "inbuf=input:buffer=True", "--routing", "exact", "--out", str(out),
                    nproc=2, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "smoke fwd T=48 EP=2, exact routing, CPU (Triton interpreter)" in lines
    assert "== s3: w13:num_stages=3+layer:pull_all=False" in lines
    assert "== inbuf: input:buffer=True" in lines and "== base: the plan's rules" in lines
    plans = r.stdout.split("== ")
    s3 = next(p for p in plans if p.startswith("s3:"))
    assert "w13        Triton W13 (override)" in s3 and "num_stages=3" in s3
    assert "pull_all=False" in s3 and "kernel plan: device class generic, EP=2" in s3
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and " x" in line}
    assert set(rows) >= {"base", "s3", "inbuf", "ep1share"}
    assert "x1.0000" in rows["base"] and "EP=2 / EP=1 share:" in rows["ep1share"]
    assert "/ EP=1 share:" in rows["base"] and "/ EP=1 share:" in rows["inbuf"]
    assert "say nothing about GPU speed" in r.stdout
    data = json.loads(out.read_text())
    assert (data["shape"], data["ep"], data["tokens"]) == ("smoke", 2, 48)
    assert data["variants"]["s3"]["overrides"] == {"w13": {"num_stages": 3},
                                                   "layer": {"pull_all": False}}
    assert data["variants"]["inbuf"]["x_in_buffer"] is True
    assert [row["name"] for row in data["rows"]] == ["base", "s3", "inbuf", "ep1share"]
    assert all(len(row["window_ms"]) == 2 for row in data["rows"])


def test_replay_and_regather_rows_time_the_same_layer(tmp_path, distmoe_cli):
    """``--replay``: a layer whose slot holds its input only (activation_factor 0), so its
    backward replays the forward, timed in the same rounds as the saved layer;
    ``--regather``: one whose saved layers keep their input instead of their rows, with
    ``--regather-in-place both`` another that reads those rows in place."""
    r = distmoe_cli("ab", "--shape", "smoke", "--tokens", "16", "--mode", "fwdbwd",
                    "--rounds", "1", "--iters", "1", "--warmup", "1", "--replay", "--regather",
                    "--regather-in-place", "both", "--routing", "exact", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    caps, name = {}, None
    for line in r.stdout.splitlines():
        if line.startswith("== "):
            name = line[3:].split(":")[0]
        if line.startswith("  activation buffer "):
            caps[name] = int(line.split("slot capacity ")[1].split()[0])
    assert set(caps) == {"base", "replay", "regather", "inplace"}
    assert 0 < caps["replay"] < caps["regather"] < caps["base"]  # EP = 1: T rows, not T*K
    assert caps["inplace"] == caps["regather"]
    assert "(activation_factor 0.0, save_gathered_rows True, rows in place False)" in r.stdout
    assert "save_gathered_rows False, rows in place True" in r.stdout
    rows = {line.split()[0]: line for line in r.stdout.splitlines()
            if line.startswith("  ") and " x" in line}
    assert set(rows) == {"base", "replay", "regather", "inplace"}
    assert "replayed / saved:" in rows["replay"]
    assert "regathered / saved:" in rows["regather"] and "regathered / saved:" in rows["inplace"]


def test_a_variant_the_plan_refuses_is_one_line(tmp_path, distmoe_cli):
    r = distmoe_cli("ab", "--shape", "smoke", "--variant", "d=w2_dgrad:num_stages=3",
                    cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "distmoe ab: error: --variant d: overrides['w2_dgrad']: the w2_dgrad kernel runs in "
        "training only")
