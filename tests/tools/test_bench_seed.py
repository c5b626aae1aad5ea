"""``python -m distmoe bench --suite seed`` (:mod:`distmoe.tools.bench.seed_suite`): the case
list, the options, the packing budgets, and one CPU run of the packing workload (tiny widths,
two layers, Triton's interpreter): both memory plans give the same bits, the per-layer budget
replays the loaded layer, and results.json has the suite's fields."""

import argparse
import json

import pytest

from distmoe.tools.bench import cli, seed_suite


def _args(*argv):
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_case_list():
    cases = seed_suite.seed_cases()
    kinds = [c.kind for c in cases]
    assert kinds == ["imbalance"] * 18 + ["width"] * 12 + ["packing"] * 3 + ["packing-shared"] * 3
    imb = [c for c in cases if c.kind == "imbalance"]
    assert {(c.mode, c.precision) for c in imb} == {
        (m, p) for m in ("fwd", "fwdbwd") for p in ("bf16", "mxfp8", "fp8_block")}
    assert sorted({c.imbalance for c in imb}) == [1.0, 4.0, 8.0]
    s = seed_suite.SEED_SHARE
    assert (s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k) == (2048, 7168, 3072, 48, 6)
    width = [c.shape for c in cases if c.kind == "width"]
    assert sorted({w.ffn for w in width}) == [512, 1024, 1536, 2048, 3072, 4096]
    # fixed T, D, E, K across the sweep
    assert {(w.tokens, w.hidden, w.num_experts, w.top_k) for w in width} == {(2048, 7168, 48, 6)}
    pack = [c for c in cases if c.kind.startswith("packing")]
    assert {(c.layers, c.mode) for c in pack} == {(10, "fwdbwd")}
    assert {c.shared_ffn for c in pack} == {0, seed_suite.PACK_SHAPE.ffn}
    assert seed_suite.layer_loads(8.0, 10) == [8.0, 1, 1, 1, 1, 8.0, 1, 1, 1, 1]
    assert len(seed_suite.seed_cases(("packing",), tiny=True, layers=2, imbalances=(4.0,))) == 1
    with pytest.raises(ValueError, match=r"--seed-cases \(wide\) must be among"):
        seed_suite.seed_cases(("wide",))
    with pytest.raises(ValueError, match=r"--pack-layers \(0\) must be an int >= 1"):
        seed_suite.seed_cases(layers=0)


def test_cli_parse():
    plan = cli.resolve_plan(_args("--suite", "seed"))
    assert plan.suite == "seed" and plan.shapes == () and plan.imbalances == (1.0, 4.0, 8.0)
    assert plan.seed_kinds == seed_suite.SEED_KINDS and plan.pack_layers == 10
    assert plan.num_cases() == seed_suite.count_rows(seed_suite.seed_cases(), plan.providers)
    plan = cli.resolve_plan(_args("--suite", "seed", "--seed-cases", "packing",
                                  "--pack-layers", "3", "--imbalance", "4"))
    assert plan.seed_kinds == ("packing",) and plan.pack_layers == 3
    assert plan.imbalances == (4.0,) and plan.num_cases() == 2  # two memory plans
    with pytest.raises(ValueError, match=r"chooses its own shapes; drop --shapes"):
        cli.resolve_plan(_args("--suite", "seed", "--shapes", "smoke"))
    with pytest.raises(ValueError, match=r"need --suite seed"):
        cli.resolve_plan(_args("--pack-layers", "3"))
    assert cli.check_cpu_shapes(_args("--suite", "seed", "--device", "cpu")) == ""


def test_pack_budget_same_bytes():
    import distmoe as dm

    b = seed_suite.pack_budget(seed_suite.PACK_SHAPE, layers=10, max_tokens=8 * 2048)
    shared, per = dm.plan_memory(b["shared"], 1), dm.plan_memory(b["per_layer"], 1)
    assert shared.slot_capacity_bytes == b["capacity"]
    assert per.slot_capacity_bytes == b["share"] and b["capacity"] - 10 * b["share"] < 10 * 128
    assert shared.scratch_bytes == per.scratch_bytes  # one scratch either way
    bal, heavy = shared.full_state_bytes(2048 * 8), shared.full_state_bytes(8 * 2048 * 8)
    # the loaded layer fits the shared slot (with the others' rows) but not its own share
    assert heavy > b["share"] and 2 * heavy + 8 * bal <= b["capacity"]


def test_packing_on_the_cpu(tmp_path, distmoe_cli):
    out = tmp_path / "seed"
    r = distmoe_cli("bench", "--device", "cpu", "--suite", "seed", "--seed-cases", "packing",
                    "--pack-layers", "2", "--imbalance", "4", "--warmup", "0", "--windows",
                    "1", "--iters", "1", "--no-ceilings", "--no-plots", "--out", str(out),
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads((out / "results.json").read_text())["cases"]
    assert [c["provider"] for c in cases] == ["distmoe", "distmoe_per_layer"]
    shared, per = cases
    for c in cases:
        assert c["status"] == "ok" and c["suite_case"] == "packing" and c["layers"] == 2
        assert c["imbalance"] == 4.0 and c["mode"] == "fwdbwd" and c["iter_ms"] > 0
        assert c["tflops"] > 0 and c["hbm_gbps"] > 0 and c["scratch_gib"] > 0
        assert c["peak_fwd_gib"] is None and "not measured on the CPU" in c["note"]
        assert c["slot_gib"] == pytest.approx(shared["slot_gib"], rel=1e-3)  # same bytes
    # the loaded layer 0 keeps its state in the shared slot, replays in its own share
    assert shared["kept"] == "RR" and per["kept"] == "IR"
    # same math under both plans: every output and gradient has the same bits
    assert per["plans_agree"] == "yes"
    header = (out / "cases.csv").read_text().splitlines()[0].split(",")
    for col in ("suite_case", "kept", "plans_agree", "peak_fwd_gib", "peak_bwd_gib",
                "scratch_gib", "slot_gib"):
        assert col in header
