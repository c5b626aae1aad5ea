"""The shared expert of distmoe.nn.MoEExperts on CPU ranks (gloo, Triton interpreter), EP 1
and 2: output and every gradient against plain PyTorch autograd of routed + shared, with and
without Qwen2-MoE's sigmoid gate, in training and inference; the init (the same bits at every
EP size), the state dict (an EP 1 checkpoint loads at EP 2 and saves back the same), strict
loading, Hugging Face loading (Qwen2-MoE and DeepSeek-V3 names) and the refusals.

Tolerance (tests/ops/test_training.py's rule, for y and every gradient): our max abs error
against torch autograd of ``moe_reference + shared_expert_ref`` on fp64 copies of the same
bf16 inputs is at most 2x the error of the same autograd in bf16 (every op rounded to bf16,
as a Hugging Face model computes it) against that fp64 oracle, plus a floor of 1/128 of the
largest fp64 magnitude, for values that round the same way but land on the other side of a
bf16 tie. The shared parameters are replicated: each rank's gradient is the part of its own
tokens, compared with the gradient of that rank's copy in the reference. Weights, checkpoints
and loads are compared bit for bit.
"""

import functools

import pytest
import torch

import distmoe as dm
from distmoe.nn import MoEExperts
from distmoe.nn.shared_expert import shared_expert_ref
from distmoe.reference import moe_reference, random_routing

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("shared_expert")

T, D, F, E, K = 16, 64, 32, 4, 2
FS = 48  # the shared expert's width, unlike F so that a mix-up shows
SEED = 7
SHARED = ("shared_w13", "shared_w2", "shared_gate_w")
PREFIX = "model.layers.0.mlp."


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _cfg(world, training=True):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=training, row_block=16, device_scratch_factor=float(world))


def _problem(world):
    """Global tokens [world*T, D] bf16, ids and scores [world*T, K], upstream gradient (fp32,
    bf16-exact)."""
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(world * T, D, generator=g).bfloat16()
    ids, scores = random_routing(world * T, E, K, generator=g, inactive_fraction=0.1)
    gy = torch.randn(world * T, D, generator=g).bfloat16().float()
    return x, ids, scores.float(), gy


def _hf(gated, module):
    """A Hugging Face MoE block's shared-expert keys (random fp32) beside the router's."""
    g = torch.Generator().manual_seed(11)
    hf = {f"{PREFIX}{module}.gate_proj.weight": torch.randn(FS, D, generator=g),
          f"{PREFIX}{module}.up_proj.weight": torch.randn(FS, D, generator=g),
          f"{PREFIX}{module}.down_proj.weight": torch.randn(D, FS, generator=g),
          f"{PREFIX}gate.weight": torch.randn(E, D, generator=g)}  # the router: not ours
    if gated:
        hf[f"{PREFIX}shared_expert_gate.weight"] = torch.randn(1, D, generator=g)
    return hf


def _cpu(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _raises(exc_type, fn, *args, **kwargs):
    """The message of the ``exc_type`` that ``fn(*args, **kwargs)`` must raise."""
    with pytest.raises(exc_type) as exc:
        fn(*args, **kwargs)
    return str(exc.value)


# ---------------------------------------------------------------------------- rank function
def _rank(rank, world, checkpoint):
    """Per variant (ungated, gated): init state dict, training forward + backward, a no-grad
    forward; then the loads (strict refusals, Hugging Face, the EP 1 checkpoint if given).
    Plus an inference module (gated) and a module without a shared expert."""
    x, ids, scores, gy = (t[rank * T:(rank + 1) * T].clone() for t in _problem(world))
    out = {}
    for gated in (False, True):
        r = out[gated] = {}
        with MoEExperts(_cfg(world), device="cpu", seed=SEED, init_std=D**-0.5,
                        shared_ffn=FS, shared_gate=gated) as m:
            r["init"] = _cpu(m.state_dict())
            xa, sa = x.clone().requires_grad_(), scores.clone().requires_grad_()
            y = m(xa, ids, sa)
            (y.float() * gy).sum().backward()
            r["y"] = y.detach()
            r["grads"] = {n: p.grad.clone() for n, p in m.named_parameters()}
            r["x"], r["scores"] = xa.grad, sa.grad
            with torch.no_grad():
                r["no_grad_y"] = m(x, ids, scores)
            # strict loading: the other variant's keys, a missing gate, a wrong shape
            full = dict(r["init"])
            if gated:
                del full["shared.gate"]
            else:
                full["shared.gate"] = torch.zeros(1, D)
            r["strict"] = _raises(RuntimeError, m.load_state_dict, full)
            bad = dict(r["init"], **{"shared.w2": torch.zeros(FS, D)})
            r["shape"] = _raises(RuntimeError, m.load_state_dict, bad)
            r["unchanged"] = _cpu(m.state_dict())  # nothing refused was written
            # Hugging Face: Qwen2-MoE (gated) or DeepSeek-V3 (ungated) names
            module = "shared_expert" if gated else "shared_experts"
            hf = _hf(gated, module)
            m.load_hf_shared_expert(hf, PREFIX, module=module)
            r["hf"] = _cpu(m.state_dict())
            missing = {k: v for k, v in hf.items() if "up_proj" not in k}
            r["hf_missing"] = _raises(KeyError, m.load_hf_shared_expert, missing, PREFIX,
                                      module=module)
            wrong = dict(hf, **{f"{PREFIX}{module}.down_proj.weight": torch.zeros(FS, D)})
            r["hf_shape"] = _raises(ValueError, m.load_hf_shared_expert, wrong, PREFIX,
                                    module=module)
            if not gated:
                r["hf_gate"] = _raises(ValueError, m.load_hf_shared_expert, _hf(True, module),
                                       PREFIX, module=module)
            if gated and checkpoint is not None:  # saved at EP 1, loaded after the HF load
                res = m.load_state_dict(checkpoint)
                r["load_result"] = (res.missing_keys, res.unexpected_keys)
                r["loaded"] = _cpu(m.state_dict())
    with MoEExperts(_cfg(world, training=False), device="cpu", seed=SEED, init_std=D**-0.5,
                    shared_ffn=FS, shared_gate=True) as m:
        out["inference"] = m(x, ids, scores)
    with MoEExperts(_cfg(world), device="cpu", seed=SEED) as m:
        out["none_strict"] = _raises(RuntimeError, m.load_state_dict, out[True]["init"])
        out["none_hf"] = _raises(ValueError, m.load_hf_shared_expert, _hf(False, "s"))
    return out


@pytest.fixture(scope="module")
def runs():
    """Per EP size, the per-rank results; EP 2 also loads EP 1's gated checkpoint."""
    return _runs()


@functools.cache
def _runs():
    # cached in the process: pytest-xdist may set a module fixture up again on the same
    # worker (its items of one module need not arrive together), and a launch costs seconds
    # in Triton's interpreter; the tests only read the results
    one = dm.launch(_rank, 1, args=(None,))
    return {1: one, 2: dm.launch(_rank, 2, args=(one[0][True]["init"],))}


# ---------------------------------------------------------------------------- reference
def _reference(dtype, world, gated, full):
    """torch autograd of routed + shared in ``dtype`` (fp64 oracle, or bf16 every op) with
    one copy of the shared weights per rank: (y, grads by name; shared ones per rank)."""
    x, ids, scores, gy = _problem(world)
    cast = (lambda t: t.double()) if dtype == torch.float64 else (lambda t: t)
    w13 = torch.stack([full[f"{e}.w13"] for e in range(E)])
    w2 = torch.stack([full[f"{e}.w2"] for e in range(E)])
    leaves = {"x": x, "scores": scores, "w13": w13, "w2": w2}
    leaves = {k: cast(v).clone().requires_grad_() for k, v in leaves.items()}
    keys = ["shared.w13", "shared.w2"] + (["shared.gate"] if gated else [])
    copies = [[cast(full[k]).clone().requires_grad_() for k in keys] for _ in range(world)]
    y = moe_reference(leaves["x"], ids, leaves["scores"], leaves["w13"], leaves["w2"])
    y = y + torch.cat([shared_expert_ref(leaves["x"][r * T:(r + 1) * T], *copies[r])
                       for r in range(world)])
    (y.to(cast(gy).dtype) * cast(gy)).sum().backward()  # bf16 y: upstream in fp32
    grads = {k: v.grad for k, v in leaves.items()}
    for i, name in enumerate(SHARED[:len(keys)]):
        grads[name] = [copies[r][i].grad for r in range(world)]
    return y.detach(), grads


def _check(name, ours, g64, g16):
    err = (ours.double() - g64).abs().max().item()
    ref_err = (g16.double() - g64).abs().max().item()
    floor = g64.abs().max().item() / 128 + 1e-6
    assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} vs bf16 reference {ref_err:.3g}"


def _merged(per_rank, key):
    out = {}
    for r in per_rank:
        out.update(r[key])
    return out


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("world", [1, 2])
def test_output_and_gradients_match_reference(runs, world, gated):
    per_rank = [r[gated] for r in runs[world]]
    full = _merged(per_rank, "init")
    y64, g64 = _reference(torch.float64, world, gated, full)
    y16, g16 = _reference(torch.bfloat16, world, gated, full)
    _check("y", torch.cat([r["y"] for r in per_rank]), y64, y16)
    for name in ("x", "scores"):
        _check(name, torch.cat([r[name] for r in per_rank]), g64[name], g16[name])
    for name in ("w13", "w2"):  # each rank's experts: a slice of the global gradient
        _check(name, torch.cat([r["grads"][name] for r in per_rank]), g64[name], g16[name])
    for name in SHARED[:3 if gated else 2]:  # replicated: this rank's tokens' part
        for rank, r in enumerate(per_rank):
            assert r["grads"][name].abs().sum() > 0, (rank, name)
            _check(f"{name} rank {rank}", r["grads"][name], g64[name][rank], g16[name][rank])
    assert gated == ("shared_gate_w" in per_rank[0]["grads"])
    for r in per_rank:  # no grad mode: the same bits, no graph
        assert _bits_equal(r["no_grad_y"], r["y"]) and r["no_grad_y"].grad_fn is None


@pytest.mark.parametrize("world", [1, 2])
def test_inference(runs, world):
    full = _merged([r[True] for r in runs[world]], "init")
    y64, _ = _reference(torch.float64, world, True, full)
    y16, _ = _reference(torch.bfloat16, world, True, full)
    _check("y", torch.cat([r["inference"] for r in runs[world]]), y64, y16)


def test_init_is_the_same_at_every_ep_size(runs):
    for gated in (False, True):
        one = runs[1][0][gated]["init"]
        for r in runs[2]:  # every rank: its experts' keys and the same shared keys as EP 1
            sd = r[gated]["init"]
            shared = sorted(k for k in sd if k.startswith("shared."))
            assert shared == (["shared.gate"] if gated else []) + ["shared.w13", "shared.w2"]
            for k, v in sd.items():
                assert _bits_equal(v, one[k]), k
        assert len(one) == 2 * E + 2 + gated
    w13 = runs[1][0][True]["init"]["shared.w13"]
    assert w13.shape == (2, FS, D)
    assert abs(w13.float().std().item() - D**-0.5) < 0.1 * D**-0.5  # the experts' init rule
    assert not torch.equal(w13[0, :F], runs[1][0][True]["init"]["0.w13"][0])  # own generator
    # the gate does not change the draws before it
    for k in ("shared.w13", "shared.w2"):
        assert _bits_equal(runs[1][0][False]["init"][k], runs[1][0][True]["init"][k])


def test_checkpoint_from_ep1_loads_at_ep2(runs):
    saved = runs[1][0][True]["init"]
    for rank, r in enumerate(runs[2]):
        g = r[True]
        assert g["load_result"] == ([], []), (rank, g["load_result"])
        assert not _bits_equal(g["hf"]["shared.w13"], saved["shared.w13"])  # a real overwrite
        for k, v in g["loaded"].items():
            assert _bits_equal(v, saved[k]), (rank, k)
    merged = _merged([r[True] for r in runs[2]], "loaded")
    assert sorted(merged) == sorted(saved)


@pytest.mark.parametrize("world", [1, 2])
def test_strict_loading(runs, world):
    for r in runs[world]:
        assert 'Unexpected key(s) in state_dict: "shared.gate"' in r[False]["strict"]
        assert 'Missing key(s) in state_dict: "shared.gate"' in r[True]["strict"]
        for gated in (False, True):
            assert (f"size mismatch for shared.w2: expected shape [D, F_s] = ({D}, {FS}), "
                    f"got ({FS}, {D})") in r[gated]["shape"]
            for k, v in r[gated]["unchanged"].items():
                assert _bits_equal(v, r[gated]["init"][k]), k
        for k in ("shared.w13", "shared.w2", "shared.gate"):  # a module without one
            assert f'"{k}"' in r["none_strict"].partition("Unexpected")[2], k


@pytest.mark.parametrize("world", [1, 2])
def test_load_hf_shared_expert(runs, world):
    for r in runs[world]:
        for gated, module in ((False, "shared_experts"), (True, "shared_expert")):
            hf, sd = _hf(gated, module), r[gated]["hf"]
            p = f"{PREFIX}{module}."
            assert torch.equal(sd["shared.w13"], torch.stack(
                [hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]]).bfloat16())
            assert torch.equal(sd["shared.w2"], hf[p + "down_proj.weight"].bfloat16())
            if gated:
                assert torch.equal(sd["shared.gate"],
                                   hf[f"{PREFIX}shared_expert_gate.weight"].bfloat16())
            assert f"{p}up_proj.weight (the shared expert) is not in" in r[gated]["hf_missing"]
            assert (f"{p}down_proj.weight has shape ({FS}, {D}), expected [D, F_s] = "
                    f"({D}, {FS})") in r[gated]["hf_shape"]
            for k in sd:  # the routed experts are untouched
                if not k.startswith("shared."):
                    assert _bits_equal(sd[k], r[gated]["init"][k]), k
        assert "shared_expert_gate.weight (a sigmoid gate" in r[False]["hf_gate"]
        assert "no shared expert (shared_ffn=None)" in r["none_hf"]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(shared_ffn=0), ValueError, r"shared_ffn \(0\) must be >= 1"),
    (dict(shared_ffn=-4), ValueError, r"shared_ffn \(-4\) must be >= 1"),
    (dict(shared_ffn=True), TypeError, r"shared_ffn must be an int or None, got bool"),
    (dict(shared_ffn=32.0), TypeError, r"shared_ffn must be an int or None, got float"),
    (dict(shared_ffn=FS, shared_gate=1), TypeError, r"shared_gate must be a bool, got int"),
    (dict(shared_gate=True), ValueError, r"shared_gate=True needs a shared expert"),
])
def test_refusals(kwargs, exc, match):
    # raised before the module builds its context: no process group needed
    with pytest.raises(exc, match=match):
        MoEExperts(_cfg(1), device="cpu", **kwargs)
