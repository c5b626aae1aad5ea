"""``python -m distmoe scaling`` (distmoe.tools.scaling): the model's terms against hand
arithmetic, the EP=2 fit reproducing its own measurement, the command on a results file."""

import argparse
import json

import pytest

from distmoe.tools import scaling
from distmoe.tools.bench.workloads import MoEShape
from distmoe.tools.scaling import Links, estimate, fit_exposed, nvlink_ms

SHAPE = MoEShape(name="toy", tokens=1000, hidden=500, ffn=100, num_experts=64, top_k=4,
                 description="")
# round numbers: 1 GB/s = 1e6 bytes per ms
LINKS = Links(nvlink_gbps=100.0, nic_gbps=10.0, nic_efficiency=0.5, hbm_gbps=1000.0,
              gpus_per_node=4)


def test_terms_by_hand():
    # EP=16: 4 nodes of 4 ranks
    r = estimate(SHAPE, "fwd", 16, 2.0, LINKS, exposed=0.5)
    assert r.nodes == 4
    # NVLink: 2 T K D 2 bytes * 3/4 at 100 GB/s, half exposed
    assert r.intra == pytest.approx(0.5 * 2 * 1000 * 4 * 500 * 2 * 0.75 / 100e6)
    # all-gather (N-1) T (2D + 8K) + reduce-scatter (N-1) T 4D at 10 * 0.5 GB/s
    assert r.collective == pytest.approx(3 * 1000 * (1000 + 32 + 2000) / 5e6)
    assert r.hbm == pytest.approx(4 * 1000 * 500 * 12 / 1000e6)
    assert r.total == pytest.approx(2.0 + r.intra + r.collective + r.hbm)
    assert r.overlapped == pytest.approx(max(2.0 + r.intra, r.collective) + r.hbm)
    assert r.all_to_all == pytest.approx(2 * 1000 * 4 * 500 * 2 * 12 / 16 / 5e6)
    # the backward doubles every moved byte, not the measured compute time
    b = estimate(SHAPE, "fwdbwd", 16, 2.0, LINKS, exposed=0.5)
    assert (b.intra, b.collective, b.hbm) == pytest.approx((2 * r.intra, 2 * r.collective,
                                                            2 * r.hbm))
    # one node: no collective; E not divisible by EP: no row
    one = estimate(SHAPE, "fwd", 4, 2.0, LINKS)
    assert (one.nodes, one.collective, one.hbm, one.all_to_all) == (1, 0.0, 0.0, 0.0)
    assert estimate(SHAPE, "fwd", 128, 2.0, LINKS) is None
    assert estimate(SHAPE, "fwd", 6, 2.0, LINKS) is None  # 64 % 6
    assert 0 < r.collective_share < 1


def test_ep2_fit_reproduces_its_measurement():
    for mode in ("fwd", "fwdbwd"):
        exposed = fit_exposed(SHAPE, mode, 1.1, 3.0, LINKS)
        two = dataclass_links(gpus_per_node=8)
        r = estimate(SHAPE, mode, 2, 3.0, two, exposed)
        assert r.total == pytest.approx(1.1 * 3.0)
    assert nvlink_ms(SHAPE, 1, LINKS) == 0.0


def dataclass_links(**kw):
    from dataclasses import replace

    return replace(LINKS, **kw)


def _results(tmp_path, rows):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"cases": rows}))
    return path


def _row(mode, ms, routing="sampled", **kw):
    base = dict(provider="distmoe", status="ok", shape="toy-d500", tokens=1000, hidden=500,
                ffn=100, num_experts=64, top_k=4, ep_size=1, precision="bf16", mode=mode,
                routing=routing, timing_method="cuda_graph", iter_ms=ms)
    return {**base, **kw}


def _args(argv):
    return scaling.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_command_on_a_results_file(tmp_path, capsys):
    path = _results(tmp_path, [
        _row("fwd", 9.0, routing="exact"), _row("fwd", 2.0),  # sampled wins
        _row("fwd", 1.0, ep_size=2), _row("fwd", 1.0, precision="mxfp8"),  # not EP=1 bf16
        _row("fwd", 1.0, transport="nccl"), _row("fwdbwd", 6.0, timing_method="cuda_eager"),
    ])
    out = tmp_path / "model.json"
    args = _args(["--results", str(path), "--ep", "8", "16", "--gpus-per-node", "4",
                  "--ep2", "toy-d500:fwd:1.05", "toy-d500:fwd:1.07:2.5", "--json", str(out)])
    assert scaling.run(args) == 0
    text = capsys.readouterr().out
    assert "check toy-d500 fwd: EP=2 / EP=1 predicted" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["ep"], r["nodes"], r["compute"]) for r in rows] == [
        ("fwd", 8, 2, 2.0), ("fwd", 16, 4, 2.0)]
    assert "| `toy-d500` | fwd | 16 | 4 |" in text


@pytest.mark.parametrize("argv, message", [
    (["--ep2", "toy-d500:train:1.1"], "must be SHAPE:MODE:RATIO"),
    (["--ep2", "toy-d500:fwd:0.9"], "the ratio must be >= 1"),
    (["--ep2", "toy-d500:fwd:x"], "must be numbers"),
    (["--ep2", "no-such:fwd:1.1:2.0"], "shape"),
    (["--ep2", "toy-d500:fwdbwd:1.1"], "without EP1_MS"),
    (["--nic-gbps", "0"], "--nic-gbps"),
])
def test_command_refusals(tmp_path, capsys, argv, message):
    path = _results(tmp_path, [_row("fwd", 2.0)])
    assert scaling.run(_args(["--results", str(path), *argv])) == 2
    assert message in capsys.readouterr().err
    empty = _results(tmp_path, [])
    assert scaling.run(_args(["--results", str(empty)])) == 2
