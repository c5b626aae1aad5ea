"""distmoe as a transformers experts implementation ("distmoe") on CPU ranks (gloo, Triton
interpreter): tiny randomly initialised Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and DeepSeek-V3
models give the logits and loss gradients of the model's own implementation, at EP = 1 and 2.

Tolerance (every logit and every parameter's gradient; flash-attention's rule, as
tests/ops/test_training.py): the oracle is the model's own ``"eager"`` experts in fp64 (same
weights, same tokens). distmoe computes the experts in bf16 (inputs and weights rounded to
bf16, h1 / h2 / h3 rounded to bf16, fp32 accumulation), so its max abs error against the
oracle must be at most 2x the error of PyTorch at that precision, plus a floor for values that
land on the other side of a bf16 tie: 1/256 (half a bf16 ulp) of the largest |logit|, 1/128
(two bf16 ulps: a gradient passes through two bf16 GEMMs) of the largest |gradient| of the
parameter, or of 1/256 of the model's largest gradient where the parameter's is smaller (a
gradient that vanishes in exact arithmetic, like a key bias's under softmax, is rounding noise
of the terms that cancel in it). "PyTorch at that precision" is, for the fp32 models, the same
model with its experts run by :func:`distmoe.reference.moe_reference` on bf16 copies (which
rounds where the kernels round), and for the bf16 experts module, its own ``"grouped_mm"`` in
bf16. The routing (each layer's top-k ids) must be the same in every run, or the comparison
would not be of the experts.

At EP = 2 each rank feeds its own tokens; expert weight gradients are summed over the ranks
(every rank's routes reach the owner), so the oracle's and the baseline's expert gradients
are all-reduced before the comparison; other parameters' gradients are per rank.

Runtime: one launch per EP size runs every check that needs a process group (on two shared
cores: 15-25 s at EP = 1, 20-50 s at EP = 2, most of it Triton's interpreter and the ranks'
import of transformers).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

import distmoe as dm
import distmoe.integrations.transformers as dmt
from distmoe.reference import moe_reference

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("transformers_parity")

BASELINE = "distmoe_test_bf16"  # the test's "PyTorch at bf16" experts implementation
BATCH, SEQ, VOCAB = 2, 8, 64  # T = 16 tokens per rank
D, F, E, K = 32, 32, 4, 2

#: tiny configs: hidden 32, expert FFN 32, 4 experts, top-2. Qwen3-MoE has two MoE layers (one
#: training context holds both between forward and backward); DeepSeek-V3 a dense layer then
#: an MoE layer with grouped routing (2 groups of 2 experts) and a shared expert, as Qwen2-MoE
#: has; the others one MoE layer. A second MoE layer routes on the first one's output, which
#: distmoe computes in bf16: a top-k near a tie could then pick other experts than the fp64
#: oracle. Its router is made sharper (see _build) and the test checks that the routing is
#: the same.
_ATTN = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
             max_position_embeddings=64)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(_ATTN, num_hidden_layers=2, num_key_value_heads=1,
                                         head_dim=16, intermediate_size=64,
                                         moe_intermediate_size=F, num_experts=E,
                                         num_experts_per_tok=K, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_ATTN, num_key_value_heads=1, intermediate_size=64,
                                         moe_intermediate_size=F, num_experts=E,
                                         num_experts_per_tok=K,
                                         shared_expert_intermediate_size=F)),
    "mixtral": ("MixtralConfig", dict(_ATTN, num_key_value_heads=1, head_dim=16,
                                      intermediate_size=F, num_local_experts=E,
                                      num_experts_per_tok=K)),
    "olmoe": ("OlmoeConfig", dict(_ATTN, num_key_value_heads=1, intermediate_size=F,
                                  num_experts=E, num_experts_per_tok=K, eos_token_id=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(_ATTN, num_hidden_layers=2, num_key_value_heads=2,
                                             intermediate_size=64, moe_intermediate_size=F,
                                             n_routed_experts=E, n_shared_experts=1,
                                             num_experts_per_tok=K, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, q_lora_rank=16,
                                             kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16)),
}
#: families also run under torch.no_grad (inference contexts; the others' calls all train)
INFERENCE_FAMILIES = ("qwen3_moe", "deepseek_v3")


# ---------------------------------------------------------------------------- helpers
def _bf16_reference_experts(module, hidden_states, top_k_index, top_k_weights):
    """The baseline experts: :func:`moe_reference` on bf16 copies (all experts here)."""
    w13, w2 = dmt.expert_weights(module)
    y = moe_reference(hidden_states.bfloat16(), top_k_index, top_k_weights, w13, w2)
    return y.to(hidden_states.dtype)


def _build(family: str, seed: int) -> nn.Module:
    """The family's tiny causal LM in fp32, train mode, every rank the same weights. Expert
    and router weights are drawn larger than the models' 0.02 init, so that the experts
    carry the residual stream and the router's top-k choices are far from ties."""
    cls_name, kwargs = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    with torch.no_grad():
        routers = 0
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                p.normal_(0.0, D**-0.5)
            elif name.endswith("experts.down_proj"):
                p.normal_(0.0, F**-0.5)
            elif name.endswith("mlp.gate.weight"):
                # router logits of std 2, then 4 behind a first MoE layer (ties 2x rarer)
                p.normal_(0.0, (2 if routers == 0 else 4) * D**-0.5)
                routers += 1
    return model.float().train()


def _tokens(seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _run(model: nn.Module, ids: torch.Tensor, *, grad: bool = True,
         inference_mode: bool = False):
    """(logits fp64, {param name: grad fp64}, routing per experts module) of one step
    (without ``grad``: under no_grad, or ``inference_mode``)."""
    routing = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: routing.append(args[1].clone()))
             for m in model.modules() if dmt.is_experts_module(m)]
    try:
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad), torch.inference_mode(inference_mode):
            out = model(ids, labels=ids)
        if grad:
            out.loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double(), grads, routing


def _expert_slice(name: str, world: int, rank: int, g: torch.Tensor) -> torch.Tensor:
    """A full model's gradient as this rank's sharded model holds it (experts: sliced)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and world > 1:
        n = g.shape[0] // world
        return g[rank * n:(rank + 1) * n]
    return g


def _sum_expert_grads(grads: dict, world: int) -> dict:
    """Expert weight gradients summed over the ranks (the owner gets every rank's routes)."""
    if world == 1:
        return grads
    out = dict(grads)
    for name in sorted(grads):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            g = grads[name].clone()
            dist.all_reduce(g)
            out[name] = g
    return out


def _errors(ours, base, oracle):
    """(max |ours - oracle|, max |base - oracle|, max |oracle|)."""
    return ((ours - oracle).abs().max().item(), (base - oracle).abs().max().item(),
            oracle.abs().max().item())


def _compare(family, model, ids, rank, world):
    """Oracle, baseline and distmoe runs of one family's fp32 model; the errors to check (see
    the module docstring), keyed by what they measure."""
    oracle = copy.deepcopy(model).double()
    oracle.set_experts_implementation("eager")
    base = copy.deepcopy(model)
    base.set_experts_implementation(BASELINE)
    ours = copy.deepcopy(model)
    sharded = dmt.shard_experts(ours)  # default: the world group (EP = world)
    assert ours.config._experts_implementation == "distmoe"

    logits64, grads64, routes64 = _run(oracle, ids)
    logits_b, grads_b, routes_b = _run(base, ids)
    logits_o, grads_o, routes_o = _run(ours, ids)  # training contexts, collective backward
    logits_inf, routes_inf = logits_o, routes_o
    if family in INFERENCE_FAMILIES:  # inference contexts: the first family builds one in
        # inference mode, the next one uses it under no_grad
        logits_inf, _, routes_inf = _run(ours, ids, grad=False, inference_mode=family
                                         == INFERENCE_FAMILIES[0])
    grads64, grads_b = _sum_expert_grads(grads64, world), _sum_expert_grads(grads_b, world)

    out = {"sharded": len(sharded),
           "same_routing": all(torch.equal(a, b) for rs in (routes_b, routes_inf, routes_o)
                               for a, b in zip(routes64, rs, strict=True))
           and len(routes64) == len(routes_o) == len(sharded),
           "logits (no_grad)": _errors(logits_inf, logits_b, logits64),
           "logits (training)": _errors(logits_o, logits_b, logits64)}
    assert sorted(grads_o) == sorted(grads64), family
    for name in grads64:
        out[f"grad {name}"] = _errors(grads_o[name],
                                      _expert_slice(name, world, rank, grads_b[name]),
                                      _expert_slice(name, world, rank, grads64[name]))
    return out


def _bf16_experts_case(rank, world, seed):
    """A bf16 model's experts module (Qwen3-MoE's first): its weights reach the context
    without a copy, and its output and the gradients of its input, scores and bf16
    parameters match the oracle as well as the module's own ``grouped_mm`` in bf16 does."""
    model = _build("qwen3_moe", seed).bfloat16()
    full = next(m for m in model.modules() if dmt.is_experts_module(m))
    ours_model = copy.deepcopy(model)
    dmt.shard_experts(ours_model)
    ours = next(m for m in ours_model.modules() if dmt.is_experts_module(m))
    w13, w2 = dmt.expert_weights(ours)
    assert w13.data_ptr() == ours.gate_up_proj.data_ptr()  # views, no copy
    assert w2.data_ptr() == ours.down_proj.data_ptr()

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(BATCH * SEQ, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(BATCH * SEQ)])
    scores = torch.rand(BATCH * SEQ, K, generator=g).bfloat16()
    gy = torch.randn(BATCH * SEQ, D, generator=g).bfloat16()

    def run(module, dtype, impl):
        module.config._experts_implementation = impl
        xs = x.to(dtype).clone().requires_grad_()  # (a leaf of its own per run)
        ss = scores.to(dtype).clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        params = [module.gate_up_proj, module.down_proj]
        saved = [p.data for p in params]
        for p in params:
            p.data = p.data.to(dtype)
        try:
            y = module(xs, ids, ss)
            (y.double() * gy.double()).sum().backward()
            gu, dn = (p.grad.double() for p in params)
        finally:
            for p, d in zip(params, saved, strict=True):
                p.data, p.grad = d, None
        return [y.detach().double(), xs.grad.double(), ss.grad.double(), gu, dn]

    oracle = run(full, torch.float64, "eager")
    base = run(full, torch.bfloat16, "grouped_mm")
    got = run(ours, torch.bfloat16, "distmoe")
    for i in (3, 4):  # expert gradients: summed over the ranks, this rank's slice
        for res in (oracle, base):
            if world > 1:
                dist.all_reduce(res[i])
            res[i] = _expert_slice("experts.down_proj", world, rank, res[i])
    names = ["output", "grad hidden_states", "grad top_k_weights", "grad gate_up_proj",
             "grad down_proj"]
    return {n: _errors(o, b, r) for n, o, b, r in zip(names, got, base, oracle, strict=True)}


# ---------------------------------------------------------------------------- rank functions
def _transposed_case(seed):
    """An experts class with the transposed layout (``is_transposed``, as Aria's): distmoe
    permutes it into w13 / w2 (a copy). Returns (distmoe's error, the bf16 reference's error,
    the model's own fp32 grouped_mm's error, max |y|), all against the fp64 reference."""

    @transformers.integrations.use_experts_implementation(is_transposed=True)
    class TransposedExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            self.gate_up_proj = nn.Parameter(torch.randn(E, D, 2 * F) * D**-0.5)
            self.down_proj = nn.Parameter(torch.randn(E, F, D) * F**-0.5)
            self.act_fn = nn.SiLU()

    cfg = transformers.PreTrainedConfig()
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    m = TransposedExperts(cfg)
    x = torch.randn(16, D)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(16)])
    w = torch.rand(16, K)
    with torch.no_grad():
        y_own = m(x, ids, w).double()  # the module's own grouped_mm, fp32
        y = dmt.distmoe_experts_forward(m, x, ids, w).double()
        w13, w2 = dmt.expert_weights(m)  # permuted copies, bf16
        y_b = _bf16_reference_experts(m, x, ids, w).double()
        w13_64 = m.gate_up_proj.double().reshape(E, D, 2, F).permute(0, 2, 3, 1)
        y64 = moe_reference(x.double(), ids, w.double(), w13_64,
                            m.down_proj.double().transpose(1, 2))
    assert w13.shape == (E, 2, F, D) and w13.is_contiguous() and w2.shape == (E, D, F)
    return tuple((t - y64).abs().max().item() for t in (y, y_b, y_own)) + (
        y64.abs().max().item(),)


def _refusals_rank(rank, world):
    """Refusals that need a process group."""
    model = _build("qwen3_moe", 1)
    ids = _tokens(1, rank)
    out = {}
    if world > 1:  # all experts on every rank, but two ranks: shard first
        model.set_experts_implementation("distmoe")
        with pytest.raises(ValueError, match=r"holds all 4 experts but torch\.distributed "
                                             r"has 2 ranks: call .*shard_experts"):
            model(ids)
        out["unsharded"] = True
    small = copy.deepcopy(model)
    dmt.shard_experts(small, options=dmt.ExpertsOptions(max_tokens=8))
    with torch.no_grad(), pytest.raises(ValueError, match=r"16 tokens on this rank, above "
                                                          r"max_tokens \(8\)"):
        small(ids)
    with pytest.raises(ValueError, match=r"sharded already"):
        dmt.shard_experts(small)
    out["max_tokens"] = True
    return out


def _parity_rank(rank, world, seed):
    """Every family, the bf16 experts, the transposed layout (EP = 1) and the refusals; the
    contexts are closed at the end (collective)."""
    transformers.integrations.moe.ExpertsInterface.register(BASELINE, _bf16_reference_experts)
    results = {}
    try:
        for family in FAMILIES:
            results[family] = _compare(family, _build(family, seed), _tokens(seed, rank), rank,
                                       world)
        results["bf16"] = _bf16_experts_case(rank, world, seed)
        if world == 1:
            results["transposed"] = _transposed_case(seed)
        results["refusals"] = _refusals_rank(rank, world)
        results["contexts"] = sorted((c.cfg.training, c.cfg.max_tokens, c.ep_size,
                                      c.cfg.max_layers_per_slot)
                                     for c in dmt.cached_contexts())
    finally:
        dmt.close_contexts()
    return results


# ---------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def parity():
    """Per EP size, the per-rank results of :func:`_parity_rank` (one launch each)."""
    return _parity()


@functools.cache
def _parity():
    # cached in the process: pytest-xdist may set a module fixture up again on the same
    # worker (its items of one module need not arrive together), and a launch costs seconds
    # in Triton's interpreter; the tests only read the results
    return {world: dm.launch(_parity_rank, world, args=(3,), device="cpu")
            for world in (1, 2)}


def _check(results: dict, skip=()):
    """Every (err, base_err, scale) entry within the rule of the module docstring; returns
    how many were checked."""
    entries = {k: v for k, v in results.items() if k not in skip}
    largest_grad = max(v[2] for k, v in entries.items() if k.startswith("grad"))
    for what, (err, base_err, scale) in entries.items():
        if what.startswith(("logits", "output")):
            floor = scale / 256
        else:
            floor = max(scale, largest_grad / 256) / 128
        assert err <= 2 * base_err + floor, (what, err, base_err, scale, floor)
    return len(entries)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_logits_and_gradients_as_the_model(parity, world, family):
    for rank, results in enumerate(parity[world]):
        res = results[family]
        assert res["sharded"] >= 1
        assert res["same_routing"], (rank, "the routing differs between runs: pick a seed "
                                           "whose top-k choices are not near ties")
        # logits twice, then the gradients of every parameter (router, experts, attention..)
        assert _check(res, skip=("sharded", "same_routing")) >= 8, (rank, sorted(res))


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_experts_without_a_copy(parity, world):
    for results in parity[world]:
        assert _check(results["bf16"]) == 5


def test_contexts_are_shared_and_cached(parity):
    # (training, max_tokens, EP, layers per slot): T = 16 -> max_tokens 16; one inference
    # context per EP size (every family's layers share it: same D, F, E, K; fp32 models and
    # the bf16 module alike), training contexts by layer count (config.num_hidden_layers: 1
    # or 2); the refusal case's max_tokens=8 context is never built (the call raises first)
    for world in (1, 2):
        for results in parity[world]:
            assert results["contexts"] == [(False, 16, world, 1), (True, 16, world, 1),
                                           (True, 16, world, 2)], results["contexts"]


def test_transposed_layout_is_permuted(parity):
    err, bf16_err, own_err, scale = parity[1][0]["transposed"]
    assert own_err <= 1e-5 * scale, own_err  # the fp64 reference reads the layout right
    assert err <= 2 * bf16_err + scale / 256, (err, bf16_err, scale)


@pytest.mark.parametrize("world", [1, 2])
def test_refusals_with_a_group(parity, world):
    for results in parity[world]:
        assert results["refusals"]["max_tokens"]
        assert results["refusals"].get("unsharded", world == 1)


def test_registered():
    assert dmt.register() == "distmoe"
    assert "distmoe" in transformers.integrations.moe.ExpertsInterface()


# ---------------------------------------------------------------------------- refusals
def _experts_class(**flags):
    """A tiny experts class under transformers' decorator with ``flags`` (has_gate, ...)."""

    @transformers.integrations.use_experts_implementation(**flags)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            rows = 2 * F if flags.get("has_gate", True) else F
            self.gate_up_proj = nn.Parameter(torch.zeros(E, rows, D))
            self.up_proj = self.gate_up_proj
            self.down_proj = nn.Parameter(torch.zeros(E, D, F))
            self.act_fn = nn.SiLU()
            self.post_expert_norm = nn.Identity()

    cfg = transformers.PreTrainedConfig()
    cfg._experts_implementation = "distmoe"
    return Experts(cfg)


@pytest.mark.parametrize("flags, match", [
    # each feature named in the error
    (dict(has_bias=True), r"expert biases \(has_bias=True"),
    (dict(has_gate=False), r"non-gated experts \(has_gate=False"),
    (dict(has_post_expert_norm=True), r"a post-expert norm"),
    (dict(is_concatenated=False), r"interleaved gate/up rows \(is_concatenated=False\)"),
])
def test_unsupported_flags_raise(flags, match):
    m = _experts_class(**flags)
    x, ids, w = torch.zeros(4, D), torch.zeros(4, K, dtype=torch.long), torch.zeros(4, K)
    with pytest.raises(ValueError, match=r"'distmoe' experts implementation cannot run "
                                         r"Experts: it has .*" + match):
        m(x, ids, w)


def test_clamped_activation_custom_gate_and_other_activations_raise():
    m = _experts_class()
    m.limit = 7.0  # clamped SwiGLU (as Step-3.7's)
    with pytest.raises(ValueError, match=r"clamped activations \(limit=7\.0\)"):
        dmt.check_experts(m)
    m = _experts_class()
    m.act_fn = nn.GELU()
    with pytest.raises(ValueError, match=r"the activation 'GELU'"):
        dmt.check_experts(m)
    m = _experts_class()
    m.gate_up_proj.data = m.gate_up_proj.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expert weights of dtype torch.float8_e4m3fn"):
        dmt.check_experts(m)
    m = _experts_class()
    m._is_expert_parallel = True  # what transformers' own EP plan sets
    with pytest.raises(ValueError, match=r"transformers' own expert parallelism"):
        dmt.check_experts(m)
    # a model whose config names another activation, through the model's forward
    cls_name, kwargs = FAMILIES["qwen3_moe"]
    cfg = getattr(transformers, cls_name)(**dict(kwargs, hidden_act="gelu"))
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="distmoe")
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts: it has the activation 'gelu'"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_gpt_oss_raises_naming_its_features():
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=F,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, num_local_experts=E,
                                    num_experts_per_tok=K, layer_types=["full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="distmoe")
    expected = (r"GptOssExperts: it has expert biases \(has_bias=True, as in GPT-OSS\); "
                r"clamped activations \(limit=7\.0\); a custom gate "
                r"\(GptOssExperts\._apply_gate.*; interleaved gate/up rows")
    with pytest.raises(ValueError, match=expected):
        model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=expected):  # before any process group is needed
        dmt.shard_experts(model)


def test_runs_without_torch_distributed():
    """A process without torch.distributed (this pytest process) runs the experts as one rank
    of its own: the same logits and gradients as the model's experts, by the parity rule."""
    assert not torch.distributed.is_initialized()
    transformers.integrations.moe.ExpertsInterface.register(BASELINE, _bf16_reference_experts)
    try:
        res = _compare("mixtral", _build("mixtral", 0), _tokens(0, 0), 0, 1)
    finally:
        dmt.close_contexts()
    assert res["same_routing"]
    assert _check(res, skip=("sharded", "same_routing")) >= 8
    assert not torch.distributed.is_initialized()


def test_options_are_validated():
    with pytest.raises(ValueError, match=r"max_tokens \(0\) must be None or an int >= 1"):
        dmt.ExpertsOptions(max_tokens=0)
    with pytest.raises(TypeError, match=r"options must be an ExpertsOptions"):
        dmt.shard_experts(_build("olmoe", 0), options={"max_tokens": 16})


def _placed_qwen3_experts(hidden, ffn, seed, std, options):
    """``(experts, x, ids, w)``: a bf16 Qwen3-MoE experts module of 4 experts with N(0, std^2)
    weights, placed by ``shard_experts`` with ``options`` (one process), and 8 tokens routed
    to 2 distinct experts each."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=ffn,
                                      num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(seed)
    experts = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn_like(experts.gate_up_proj) * std)
        experts.down_proj.copy_(torch.randn_like(experts.down_proj) * std)
    dmt.shard_experts(experts, options=options)
    x = torch.randn(8, hidden).bfloat16()
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(8)])
    return experts, x, ids, torch.rand(8, 2)


def test_inference_precision_option():
    # ExpertsOptions(inference_precision=...): inference calls run at that precision on the
    # module's weights prepared once per weight version (the bits of the context called with
    # prepare_weights of the same weights); a training call stays bf16 (one process, CPU)
    import distmoe as dm

    experts, x, ids, w = _placed_qwen3_experts(
        128, 128, 4, 128**-0.5, dmt.ExpertsOptions(inference_precision="fp8_block",
                                                   row_block=16))
    try:
        with torch.no_grad():
            y = dmt.distmoe_experts_forward(experts, x, ids, w)
            first = experts._distmoe_prepared[1]
            dmt.distmoe_experts_forward(experts, x, ids, w)
            assert experts._distmoe_prepared[1] is first  # the same weight version
            (ctx,) = [c for c in dmt.cached_contexts() if c.cfg.precision == "fp8_block"]
            want = ctx(x, ids, w, *dm.prepare_weights(*dmt.expert_weights(experts),
                                                      "fp8_block"))
            assert torch.equal(y.view(torch.int16), want.view(torch.int16))
            experts.down_proj.mul_(0.5)  # in place: prepared again at the next call
            dmt.distmoe_experts_forward(experts, x, ids, w)
            assert experts._distmoe_prepared[1] is not first
        xg = x.clone().requires_grad_(True)
        dmt.distmoe_experts_forward(experts, xg, ids, w).float().sum().backward()
        assert xg.grad is not None
        assert {c.cfg.precision for c in dmt.cached_contexts() if c.cfg.training} == {"bf16"}
    finally:
        dmt.close_contexts()
    with pytest.raises(ValueError, match=r"inference_precision \('fp4'\) must be"):
        dmt.ExpertsOptions(inference_precision="fp4")


def test_training_precision_option():
    # ExpertsOptions(training_precision="mxfp8"): a training call runs on an mxfp8 training
    # context, which takes the module's bf16 weights (the bits of that context called
    # directly with the same weights); gradients reach the input and both parameters
    # (one process, CPU)
    experts, x, ids, w = _placed_qwen3_experts(
        64, 32, 5, 1 / 8, dmt.ExpertsOptions(training_precision="mxfp8", row_block=16))
    x.requires_grad_(True)
    try:
        y = dmt.distmoe_experts_forward(experts, x, ids, w)
        (ctx,) = [c for c in dmt.cached_contexts() if c.cfg.training]
        assert ctx.cfg.precision == "mxfp8"
        y.float().sum().backward()
        assert x.grad is not None and experts.down_proj.grad is not None
        assert experts.gate_up_proj.grad.abs().sum() > 0
        want = ctx(x.detach().requires_grad_(True), ids, w, *dmt.expert_weights(experts))
        assert torch.equal(y.detach().view(torch.int16), want.detach().view(torch.int16))
    finally:
        dmt.close_contexts()
    # set_options: the next training call takes a bf16 context
    assert dmt.set_options(experts, dmt.ExpertsOptions(row_block=16)) == 1
    try:
        dmt.distmoe_experts_forward(experts, x, ids, w).float().sum().backward()
        assert {c.cfg.precision for c in dmt.cached_contexts() if c.cfg.training} == {"bf16"}
    finally:
        dmt.close_contexts()
    with pytest.raises(ValueError, match=r"has no experts module placed by shard_experts"):
        dmt.set_options(torch.nn.Linear(2, 2), dmt.ExpertsOptions())
    with pytest.raises(ValueError, match=r"training_precision \('nvfp4'\) must be"):
        dmt.ExpertsOptions(training_precision="nvfp4")
