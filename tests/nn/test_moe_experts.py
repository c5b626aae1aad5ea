"""distmoe.nn.MoEExperts on CPU ranks (gloo, Triton interpreter): forward against the
reference, initialisation and checkpoints independent of the EP size, strict loading, the
Hugging Face adapter, and gradients equal to the context-level call's.

Tolerance (forward, as tests/ops/forward_cases.py's check_against_reference): our max error
against the fp64 reference is at most 2x the bf16 PyTorch reference's (which rounds h1, h2,
h3 to bf16 like the layer) plus half a bf16 ulp of the largest |y|, for ties rounded the other
way. Everything else (weights, checkpoints, gradients of the same kernels on the same inputs)
is compared bit for bit.
"""

import functools

import pytest
import torch

import distmoe as dm
from distmoe.nn import MoEExperts
from distmoe.reference import moe_reference, random_routing

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("moe_experts")

T, D, F, E, K = 16, 64, 32, 4, 2


def _cfg(world, training=False):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=training, row_block=16, device_scratch_factor=float(world))


def _problem(seed, world):
    """Global tokens [world*T, D] bf16, ids and scores [world*T, K], upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * T, D, generator=g).bfloat16()
    ids, scores = random_routing(world * T, E, K, generator=g, inactive_fraction=0.1)
    gy = torch.randn(world * T, D, generator=g).bfloat16()
    return x, ids, scores.float(), gy


def _mine(rank, t):
    return t[rank * T:(rank + 1) * T].clone()


def _cpu(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def _merge(per_rank_dicts):
    """The union of the ranks' sharded state dicts (no key may appear twice)."""
    out = {}
    for sd in per_rank_dicts:
        assert not set(out) & set(sd), "two ranks saved the same key"
        out.update(sd)
    return out


def _global(sd, prefix=""):
    """(w13 [E, 2, F, D], w2 [E, D, F]) from a full per-expert state dict."""
    return (torch.stack([sd[f"{prefix}{e}.w13"] for e in range(E)]),
            torch.stack([sd[f"{prefix}{e}.w2"] for e in range(E)]))


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---------------------------------------------------------------------------- rank functions
def _forward_rank(rank, world, seed):
    """Build with ``seed``, run one inference call; returns (y, state dict)."""
    x, ids, scores, _ = _problem(seed + 1, world)
    with MoEExperts(_cfg(world), device="cpu", seed=seed, init_std=D**-0.5) as m:
        assert m.global_experts == range(rank * E // world, (rank + 1) * E // world)
        y = m(_mine(rank, x), _mine(rank, ids), _mine(rank, scores))
        return y, _cpu(m.state_dict())


def _checkpoint_rank(rank, world, other_full, fused):
    """Load a full checkpoint saved at another EP size (merged per-expert dicts) into a
    module initialised differently, then its fused-tensor form; returns the state dicts
    after each load and after a save -> load -> save round trip (prefixed, inside a parent
    module, through nn.Module's machinery)."""
    with MoEExperts(_cfg(world), device="cpu", seed=12345) as m:
        parent = torch.nn.Module()
        parent.experts = m
        res = parent.load_state_dict({f"experts.{k}": v for k, v in other_full.items()})
        assert not res.missing_keys and not res.unexpected_keys, res
        after_merged = _cpu(m.state_dict())
        m.reset_parameters()
        m.load_state_dict(fused)  # fused [E, ...] tensors: each rank takes its slice
        after_fused = _cpu(m.state_dict())
        saved = _cpu(parent.state_dict())
        m.reset_parameters()  # (different bits again, then back)
        parent.load_state_dict(saved)
        resaved = _cpu(parent.state_dict())
    return after_merged, after_fused, saved, resaved


def _strict_rank(rank, world, full):
    """Every refusal of strict loading, as the error messages (or key lists) it gives."""
    out = {}
    with MoEExperts(_cfg(world), device="cpu", seed=3) as m:
        mine = {k: v for k, v in full.items() if int(k.split(".")[0]) in m.global_experts}
        missing = dict(mine)
        del missing[f"{m.first_expert}.w2"]
        with pytest.raises(RuntimeError) as exc:
            m.load_state_dict(missing)
        out["missing"] = str(exc.value)
        res = m.load_state_dict(missing, strict=False)
        out["missing_lax"] = (res.missing_keys, res.unexpected_keys)
        extra = dict(full, bias=torch.zeros(1), **{f"{E}.w13": full["0.w13"]})
        extra[f"{m.first_expert}.w13_scale"] = torch.ones(1)
        with pytest.raises(RuntimeError) as exc:
            m.load_state_dict(extra)
        out["extra"] = str(exc.value)
        bad = dict(mine)
        bad[f"{m.first_expert}.w13"] = torch.zeros(2, D, F, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError) as exc:
            m.load_state_dict(bad)
        out["shape"] = str(exc.value)
        with pytest.raises(RuntimeError) as exc:
            m.load_state_dict({"w13": torch.zeros(E, 2, F, D + 8), "w2": torch.zeros(E, D, F)})
        out["fused_shape"] = str(exc.value)
        # nothing above that was refused may have half-written a wrong value: a clean load
        # of the full checkpoint still round-trips
        m.load_state_dict(full, strict=False)
        out["clean"] = _cpu(m.state_dict())
    return out


def _hf_rank(rank, world, hf, names, prefix):
    with MoEExperts(_cfg(world), device="cpu", seed=1) as m:
        m.load_hf_experts(hf, prefix, names=names)
        out = _cpu(m.state_dict())
        broken = {k: v for k, v in hf.items() if f".{m.first_expert}.{names[1]}." not in k}
        with pytest.raises(KeyError, match=rf"{prefix}{m.first_expert}\.{names[1]}\.weight"):
            m.load_hf_experts(broken, prefix, names=names)
        wrong = dict(hf)
        wrong[f"{prefix}{m.first_expert}.{names[2]}.weight"] = torch.zeros(F, D)
        with pytest.raises(ValueError, match=r"expected \[D, F\] = \(64, 32\)"):
            m.load_hf_experts(wrong, prefix, names=names)
        assert _bits_equal(m.w13, torch.stack([out[f"{e}.w13"] for e in m.global_experts]))
    return out


def _training_rank(rank, world, seed):
    """Forward + backward through the module, then through the context-level call with
    copies of the same weights (the module's own context): the same y and gradients."""
    x, ids, scores, gy = (_mine(rank, t) for t in _problem(seed, world))
    with MoEExperts(_cfg(world, training=True), device="cpu", seed=seed,
                    init_std=D**-0.5) as m:
        xa, sa = x.clone().requires_grad_(), scores.clone().requires_grad_()
        y = m(xa, ids, sa)
        assert y.grad_fn is not None
        y.backward(gy)
        w13 = m.w13.detach().clone().requires_grad_()
        w2 = m.w2.detach().clone().requires_grad_()
        xb, sb = x.clone().requires_grad_(), scores.clone().requires_grad_()
        y_ctx = m.context(xb, ids, sb, w13, w2)
        y_ctx.backward(gy)
        return [(a.detach(), b.detach()) for a, b in (
            (y, y_ctx), (m.w13.grad, w13.grad), (m.w2.grad, w2.grad), (xa.grad, xb.grad),
            (sa.grad, sb.grad))]


def _shared_context_rank(rank, world):
    """Two layers on one context (a stack): the context is not closed by the modules; a
    module refuses a context of another shape."""
    cfg = dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T, training=True,
                       row_block=16, device_scratch_factor=float(world), max_layers_per_slot=2)
    x, ids, scores, gy = (_mine(rank, t) for t in _problem(5, world))
    with dm.MoEContext(cfg, device="cpu") as ctx:
        a = MoEExperts(cfg, context=ctx, seed=1)
        b = MoEExperts(cfg, context=ctx, seed=2)
        h = b(a(x, ids, scores), ids, scores)
        h.backward(gy)
        grads = all(t.grad is not None and t.grad.abs().sum() > 0
                    for t in (a.w13, a.w2, b.w13, b.w2))
        a.close()
        b.close()
        ctx.check_open()  # still open: the modules do not own it
        other = dm.MoEConfig(hidden=D, ffn=F + 8, num_experts=E, top_k=K, max_tokens=T)
        with pytest.raises(ValueError, match=r"context\.cfg .* must equal cfg"):
            MoEExperts(other, context=ctx)
    return grads


def _refusals_rank(rank, world):
    cfg = _cfg(world)
    with pytest.raises(ValueError, match=r"dtype \(torch.float32\) must be torch.bfloat16"):
        MoEExperts(cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"init_std \(-1\) must be a number >= 0"):
        MoEExperts(cfg, init_std=-1)
    with pytest.raises(TypeError, match="cfg must be a distmoe.MoEConfig"):
        MoEExperts({"hidden": D})
    return True


# ---------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def saved():
    """Per EP size: (per-rank (y, state dict), merged full state dict), same seed."""
    return _saved()


@functools.cache
def _saved():
    # cached in the process: pytest-xdist may set a module fixture up again on the same
    # worker (its items of one module need not arrive together), and a launch costs seconds
    # in Triton's interpreter; the tests only read the results
    out = {}
    for world in (1, 2):
        per_rank = dm.launch(_forward_rank, world, args=(7,))
        out[world] = (per_rank, _merge([sd for _, sd in per_rank]))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_forward_matches_reference(saved, world):
    per_rank, full = saved[world]
    w13, w2 = _global(full)
    x, ids, scores, _ = _problem(7 + 1, world)
    y = torch.cat([y for y, _ in per_rank])
    y64 = moe_reference(x.double(), ids, scores.double(), w13.double(), w2.double())
    y16 = moe_reference(x, ids, scores, w13, w2)
    err = (y.double() - y64).abs().max().item()
    ref_err = (y16.double() - y64).abs().max().item()
    assert err <= 2 * ref_err + y64.abs().max().item() / 256, (err, ref_err)


def test_same_global_experts_at_every_ep_size(saved):
    # EP=1 and EP=2 built with the same seed: the same keys and bits for every global expert
    full1, full2 = saved[1][1], saved[2][1]
    assert sorted(full1) == sorted(full2) == sorted(f"{e}.{n}" for e in range(E)
                                                    for n in ("w13", "w2"))
    for k in full1:
        assert _bits_equal(full1[k], full2[k]), k
    # each rank saved exactly its own experts
    assert [sorted(sd) for _, sd in saved[2][0]] == [["0.w13", "0.w2", "1.w13", "1.w2"],
                                                     ["2.w13", "2.w2", "3.w13", "3.w2"]]
    # the init is N(0, std^2) in shape, std D**-0.5 here
    w13, w2 = _global(full1)
    assert abs(w13.float().std().item() - D**-0.5) < 0.1 * D**-0.5
    # and a different seed gives other weights
    assert not torch.equal(w13, _global(dm.launch(_forward_rank, 1, args=(8,))[0][1])[0])


@pytest.mark.parametrize("world, other", [(1, 2), (2, 1)])
def test_checkpoint_loads_at_another_ep_size(saved, world, other):
    full = saved[other][1]
    w13, w2 = _global(full)
    per_rank = dm.launch(_checkpoint_rank, world, args=(full, {"w13": w13, "w2": w2}))
    merged, fused, first, second = (_merge([r[i] for r in per_rank]) for i in range(4))
    for got in (merged, fused):
        assert sorted(got) == sorted(full)
        for k in full:
            assert _bits_equal(got[k], full[k]), k
    assert sorted(first) == sorted(second) == sorted(f"experts.{k}" for k in full)
    for k in first:
        assert _bits_equal(first[k], second[k]) and _bits_equal(first[k], full[k[8:]]), k


@pytest.mark.parametrize("world", [1, 2])
def test_strict_loading_names_keys_and_shapes(saved, world):
    full = saved[1][1]
    for rank, out in enumerate(dm.launch(_strict_rank, world, args=(full,))):
        first = rank * (E // world)
        assert f'Missing key(s) in state_dict: "{first}.w2"' in out["missing"]
        assert out["missing_lax"] == ([f"{first}.w2"], [])  # reported, not raised
        # other ranks' experts in the dict are not unexpected; foreign names and experts
        # outside [0, E) are
        assert "Unexpected key(s) in state_dict: " in out["extra"]
        for key in ("bias", f"{E}.w13", f"{first}.w13_scale"):
            assert f'"{key}"' in out["extra"], key
        assert '"0.w13"' not in out["extra"] and '"3.w2"' not in out["extra"]
        assert (f"size mismatch for {first}.w13: expected shape [2, F, D] = (2, {F}, {D}), "
                f"got (2, {D}, {F})") in out["shape"]
        assert (f"size mismatch for w13: expected shape [E, 2, F, D] = ({E}, 2, {F}, {D}), "
                f"got ({E}, 2, {F}, {D + 8})") in out["fused_shape"]
        for k, v in out["clean"].items():
            assert _bits_equal(v, full[k]), k


@pytest.mark.parametrize("world, names", [(1, ("gate_proj", "up_proj", "down_proj")),
                                          (2, ("w1", "w3", "w2"))])
def test_load_hf_experts(world, names):
    prefix = "model.layers.0.mlp.experts."
    g = torch.Generator().manual_seed(11)
    gate, up = torch.randn(E, F, D, generator=g), torch.randn(E, F, D, generator=g)
    down = torch.randn(E, D, F, generator=g)
    hf = {}
    for e in range(E):
        hf[f"{prefix}{e}.{names[0]}.weight"] = gate[e]
        hf[f"{prefix}{e}.{names[1]}.weight"] = up[e]
        hf[f"{prefix}{e}.{names[2]}.weight"] = down[e]
    hf["model.layers.0.mlp.gate.weight"] = torch.randn(E, D)  # the router: not the experts'
    full = _merge(dm.launch(_hf_rank, world, args=(hf, names, prefix)))
    w13, w2 = _global(full)
    assert torch.equal(w13, torch.stack([gate, up], 1).bfloat16())
    assert torch.equal(w2, down.bfloat16())


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_equal_the_context_call(world):
    for rank, pairs in enumerate(dm.launch(_training_rank, world, args=(21,))):
        for name, (ours, ctx) in zip(["y", "w13", "w2", "x", "scores"], pairs, strict=True):
            assert ours is not None and torch.equal(ours, ctx), (rank, name)
        assert pairs[1][0].abs().sum() > 0, "w13 got no gradient"


def test_shared_context_serves_a_stack():
    assert dm.launch(_shared_context_rank, 2) == [True, True]


def test_refusals():
    assert dm.launch(_refusals_rank, 1) == [True]
