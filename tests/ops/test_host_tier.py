"""Host-backed (VMM) scratch in bf16 inference (issue 62, item 2): with
``cfg.total_scratch_factor`` a rank executes up to the larger receive bound, the h2 rows past
the device bound living in pinned host pages of the same virtual range
(:class:`distmoe.runtime.vmm.TieredRange`; on a CPU device both tiers are ordinary memory
and the same code places the rows). Checked: the skewed case drops routes at the device
bound alone and none with the host tier; its output is bit for bit the output of a context
whose device tier holds every row (same kernels, same rows, other pages) and within the
forward tests' bound of the float64 reference; the tiers' bytes are the rows' bytes; the
contexts that cannot take the tier refuse it before any buffer exists."""

import dataclasses

import pytest
import torch
from forward_cases import check_against_reference, make_problem

import distmoe as dm
from distmoe.reference import split_global_problem

T, D, F, E, K = 16, 64, 64, 8, 2
DEVICE_FACTOR = 0.5  # the device bound: half the balanced rows


def _cfg(**kw):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, training=False,
                        row_block=16, device_scratch_factor=DEVICE_FACTOR, **kw)


def _tier_rank(rank, world, seed, device="cpu"):
    dev = torch.device("cpu") if device == "cpu" else \
        torch.device("cuda", torch.cuda.current_device())
    x, ids, scores, w13, w2 = make_problem(seed, world, T, D, F, E, K, "imbalance_8x")
    mine = split_global_problem(x, ids, scores, w13, w2, world)[rank]
    args = [t.to(dev) for t in (mine.x, mine.expert_ids, mine.scores, mine.w13, mine.w2)]
    out = {}
    for label, cfg in (("device_only", _cfg()),
                       ("tiered", _cfg(total_scratch_factor=float(world))),
                       ("all_device", dataclasses.replace(
                           _cfg(), device_scratch_factor=float(world)))):
        with dm.MoEContext(cfg, device=dev) as ctx:
            y = ctx(*args)
            stats = ctx.stats()
            stats["explain"] = ctx.explain()
            if ctx.scratch_range is not None:
                last = max(stats["last_recv_rows"] - 1, 0)  # the last executed row's h2
                stats["last_row_tier"] = ctx.scratch_range.location_of(last * F * 2)
                stats["first_row_tier"] = ctx.scratch_range.location_of(0)
            out[label] = (y.cpu(), stats)
    return out


def _check(per_rank, world, seed):
    tiered = [r["tiered"] for r in per_rank]
    dropped_alone = sum(r["device_only"][1]["dropped_rows"] for r in per_rank)
    assert dropped_alone > 0, "the case must exceed the device bound"
    busiest = max(tiered, key=lambda o: o[1]["last_recv_rows"])[1]
    assert busiest["last_recv_rows"] > busiest["device_rows"], busiest
    for (y, s), r in zip(tiered, per_rank, strict=True):
        assert s["dropped_rows"] == 0, s
        assert s["receive_bound"] == _cfg(total_scratch_factor=float(world)).receive_bound(
            world, total=True) and s["device_rows"] == _cfg().receive_bound(world)
        tiers = s["scratch_tiers"]
        gran = tiers["device"] - s["device_rows"] * F * 2  # 0 on the CPU, page rounding on GPU
        assert 0 <= gran and tiers["host"] >= (s["receive_bound"] - s["device_rows"]) * F * 2
        if s["last_recv_rows"] * F * 2 > tiers["device"]:
            assert s["last_row_tier"] == "host"
        assert s["first_row_tier"] == "device"
        assert (f"receive bound: {s['receive_bound']} rows, h2 scratch of the first "
                f"{s['device_rows']} in device memory") in s["explain"]
        y_all, s_all = r["all_device"]
        assert s_all["dropped_rows"] == 0 and "scratch_tiers" not in s_all
        assert torch.equal(y, y_all), "the host tier changed a bit"
    check_against_reference(tiered, seed, world, T, D, F, E, K, "imbalance_8x")


@pytest.mark.parametrize("world", [1, 2])
def test_rows_past_the_device_bound_run_from_host_scratch(world):
    seed = 31 + world
    _check(dm.launch(_tier_rank, world, args=(seed,)), world, seed)


@pytest.mark.gpu
def test_host_tier_on_one_gpu_with_two_ranks():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seed = 33
    _check(dm.launch(_tier_rank, 2, args=(seed, "cuda"), device="cuda", gpus=[0],
                     timeout=600), 2, seed)


@pytest.mark.parametrize("kw, match", [
    (dict(training=True), "a training context's scratch rows and slots are written by its "
                          "peers"),
    (dict(precision="mxfp8"), "the mxfp8 layer's scratch is device memory only"),
])
def test_contexts_that_cannot_take_the_tier_refuse_it(kw, match):
    cfg = dataclasses.replace(_cfg(total_scratch_factor=2.0), **kw)
    with pytest.raises(ValueError, match=r"total_scratch_factor \(2\): host-backed \(VMM\) "
                                         r"scratch serves bf16 inference only: " + match):
        dm.MoEContext(cfg, device="cpu")
    with pytest.raises(ValueError, match=r"needs the peer transport, this context resolved "
                                         r"'nccl' to 'nccl'"):
        dm.MoEContext(_cfg(total_scratch_factor=2.0), device="cpu", transport="nccl")
