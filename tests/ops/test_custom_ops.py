"""The layer through torch.library custom ops (distmoe.ops.custom_ops): torch.compile with
fullgraph=True, non-strict make_fx, and activation checkpointing, on CPU (Triton interpreter).

Comparisons: where the compiled graph runs the same kernels as eager (the layer's kernels in
every backend; the surrounding Linear / softmax / topk ops under ``aot_eager`` and ``make_fx``,
which run the same aten ops), outputs and gradients are compared bit for bit. Under inductor
the surrounding ops are fused and reduce in another order, so what flows through them gets a
tolerance of 2 bf16 ulps of the largest magnitude (1/64 of the max): on CPU the gradients of
x, the first Linear and the router; on GPU everything (see ``_check_inductor``).
"""

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import checkpoint

import distmoe as dm
from distmoe.nn import MoEExperts
from distmoe.ops import custom_ops

D = F = 32
T, E, K = 20, 8, 2
FWD = torch.ops.distmoe.moe_train_forward.default
BWD = torch.ops.distmoe.moe_train_backward.default
INFER = torch.ops.distmoe.moe_forward.default


def _cfg(world=1, training=True, **kw):
    return dm.MoEConfig(hidden=D, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                        training=training, row_block=16, device_scratch_factor=float(world),
                        **kw)


class TinyModel(nn.Module):
    """Linear -> router (fp32 softmax, top-k) -> distmoe experts -> Linear; with ``ckpt`` the
    experts (and a ReLU after them, which saves its output) run inside
    torch.utils.checkpoint(use_reentrant=False), with ``context_fn`` if given."""

    def __init__(self, cfg, device="cpu", ckpt=False, context_fn=None):
        super().__init__()
        self.inp = nn.Linear(D, D, dtype=torch.bfloat16, device=device)
        self.router = nn.Linear(D, E, device=device)
        self.experts = MoEExperts(cfg, device=device, seed=7)
        self.out = nn.Linear(D, D, dtype=torch.bfloat16, device=device)
        self.ckpt, self.context_fn = ckpt, context_fn

    def moe(self, h, ids, scores):
        return self.experts(h, ids, scores).relu()

    def forward(self, x):
        h = self.inp(x)
        scores, ids = self.router(h.float()).softmax(-1).topk(K)
        if self.ckpt:
            kw = {} if self.context_fn is None else {"context_fn": self.context_fn}
            y = checkpoint(self.moe, h, ids, scores, use_reentrant=False, **kw)
        else:
            y = self.moe(h, ids, scores)
        return self.out(y)


def _step(model, fn, x, gy):
    """Forward and backward: [y, x.grad, every parameter's grad]."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (y.float() * gy).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _inputs(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16().to(device)
    gy = torch.randn(T, D, generator=g).to(device)
    return x, gy


class Recorder:
    """A torch.compile backend: AOT autograd with no-op compilers (aot_eager's), recording
    Dynamo's graphs and the forward and backward graphs AOT autograd hands on."""

    def __init__(self):
        self.dynamo, self.fw, self.bw = [], [], []

    def _keep(self, graphs):
        def compiler(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)
        return aot_autograd(fw_compiler=self._keep(self.fw),
                            bw_compiler=self._keep(self.bw))(gm, example_inputs)


def _targets(graphs):
    return [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_context_numbers_are_per_context():
    """Each context gets its number at construction (what traced graphs carry); the table
    finds it while it lives."""
    a, b = dm.MoEContext(_cfg(1)), dm.MoEContext(_cfg(1))
    try:
        assert a.op_number != b.op_number
        assert custom_ops.context_id(a) == a.op_number
        assert custom_ops._context(b.op_number) is b
    finally:
        a.close()
        b.close()


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = TinyModel(_cfg())
    x, gy = _inputs()
    eager = _step(model, model, x, gy)
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True)
    for _ in range(2):  # the second call replays the compiled graph
        got = _step(model, compiled, x, gy)
        assert all(_bits_equal(a, b) for a, b in zip(eager, got, strict=True))
    assert len(rec.dynamo) == 1  # one graph: no break at the layer (fullgraph would raise)
    assert _targets(rec.dynamo).count(FWD) == 1
    assert _targets(rec.fw).count(FWD) == 1 and BWD not in _targets(rec.fw)
    assert _targets(rec.bw).count(BWD) == 1 and FWD not in _targets(rec.bw)
    acts = model.experts.context.activations
    assert acts.depth == [0]  # every forward's layer left its slot in its backward
    assert not custom_ops._CALLS  # and its saved state left the table
    # eager calls keep their own path: the autograd Function, no custom op
    y = model.experts(x, torch.zeros(T, K, dtype=torch.int64) + torch.arange(K),
                      torch.full((T, K), 0.5, requires_grad=True))
    assert type(y.grad_fn).__name__ == "MoEFunctionBackward"
    del y  # its graph owns the layer: reset_slots refuses while it lives
    acts.reset_slots()
    model.experts.close()


def test_compile_inference_op():
    """No grad (training context) and an inference context: the op without autograd, whose
    real implementation is the eager call."""
    torch.manual_seed(0)
    x, _ = _inputs()
    for training in (True, False):
        model = TinyModel(_cfg(training=training))
        with torch.no_grad():
            eager = model(x)
            rec = Recorder()
            got = torch.compile(model, backend=rec, fullgraph=True)(x)
        assert _bits_equal(eager, got)
        assert INFER in _targets(rec.fw) and FWD not in _targets(rec.fw)
        model.experts.close()


def test_make_fx_traces_forward_and_backward():
    torch.manual_seed(0)
    experts = MoEExperts(_cfg(), seed=3)
    ctx = experts.context
    x, gy = _inputs()
    x = x.requires_grad_(True)
    scores, ids = torch.randn(T, E).softmax(-1).topk(K)
    scores.requires_grad_(True)

    def step(x, ids, scores, w13, w2, gy):
        y = ctx(x, ids, scores, w13, w2)
        return (y, *torch.autograd.grad((y.float() * gy).sum(), (x, scores, w13, w2)))

    args = (x, ids, scores, experts.w13, experts.w2, gy)
    eager = step(*args)
    for mode in ("fake", "real"):
        gm = make_fx(step, tracing_mode=mode)(*args)  # non-strict: no Dynamo
        targets = _targets([gm])
        assert targets.count(FWD) == 1 and targets.count(BWD) == 1, mode
        assert ctx.activations.depth == [0]
        got = gm(*args)  # the traced graph runs the layer
        assert all(_bits_equal(a, b) for a, b in zip(eager, got, strict=True)), mode
    assert not custom_ops._CALLS
    experts.close()


def test_checkpoint_under_compile():
    """Plain non-reentrant checkpointing recomputes the layer's forward in backward inside
    torch.compile: a clear error before the layer runs twice. With the selective policy of
    custom_ops.checkpoint_context_fn the layer's outputs are saved and the rest recomputed:
    the eager gradients, bit for bit."""
    torch.manual_seed(0)
    model = TinyModel(_cfg())
    x, gy = _inputs()
    eager = _step(model, model, x, gy)
    model.ckpt = True
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="forward ran again during backward"):
        _step(model, compiled, x, gy)
    ctx = model.experts.context
    assert ctx.activations.depth == [1]  # the original forward's layer, as the error says
    ctx.reset_slots()
    model.context_fn = custom_ops.checkpoint_context_fn
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = _step(model, compiled, x, gy)
    assert all(_bits_equal(a, b) for a, b in zip(eager, got, strict=True))
    assert ctx.activations.depth == [0]
    model.experts.close()


def test_check_mode_training_refused():
    ctx = dm.MoEContext(_cfg(), device="cpu", check=True)
    w13 = torch.zeros(E, 2, F, D, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.zeros(E, D, F, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.arange(K).repeat(T, 1)
    scores = torch.full((T, K), 0.5)
    x = torch.zeros(T, D, dtype=torch.bfloat16)
    gm = make_fx(lambda *a: ctx(*a), tracing_mode="fake")(x, ids, scores, w13, w2)
    with pytest.raises(ValueError, match="check=True: a checked training call runs eagerly"):
        gm(x, ids, scores, w13, w2)
    assert ctx.activations.depth == [0]
    ctx.close()


def _inductor_tolerance(name, a, b):
    if _bits_equal(a, b):
        return
    tol = a.float().abs().max().item() / 64 + 1e-6
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, f"{name}: {err:.3g} > {tol:.3g}"


def _check_inductor(device, steps=1):
    """Inductor against eager. On CPU y and the gradients of the experts and of the last
    Linear come out bit-equal (inductor calls the same kernels there, and its fused router
    changes only what flows back through the router); elsewhere, and on GPU everywhere
    (inductor's Triton softmax may move the scores by an ulp), 2 bf16 ulps of the max."""
    torch.manual_seed(0)
    model = TinyModel(_cfg(), device=device)
    x, gy = _inputs(device)
    eager = _step(model, model, x, gy)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    names = ["y", "x.grad"] + [n for n, _ in model.named_parameters()]
    for _ in range(steps):
        got = _step(model, compiled, x, gy)
        for name, a, b in zip(names, eager, got, strict=True):
            exact = name == "y" or name.startswith(("experts.", "out."))
            if exact and device == "cpu":
                assert _bits_equal(a, b), name
            else:
                _inductor_tolerance(name, a, b)
    assert model.experts.context.activations.depth == [0]
    model.experts.close()


def test_compile_inductor_cpu():
    _check_inductor("cpu")


@pytest.mark.gpu
def test_compile_inductor_gpu():
    """The same on one GPU with inductor, three compiled steps (the context's own CUDA graphs
    capture and replay inside the ops from the second call of a key on)."""
    _check_inductor(torch.device("cuda", torch.cuda.current_device()), steps=3)


def _two_rank(rank, world):
    torch.manual_seed(0)
    model = TinyModel(_cfg(world))
    x, gy = _inputs(seed=rank)
    eager = _step(model, model, x, gy)
    got = _step(model, torch.compile(model, backend="aot_eager", fullgraph=True), x, gy)
    same = all(_bits_equal(a, b) for a, b in zip(eager, got, strict=True))
    depth = model.experts.context.activations.depth
    model.experts.close()
    return same, depth


def test_compile_two_ranks():
    for same, depth in dm.launch(_two_rank, 2, timeout=120):
        assert same and depth == [0]
