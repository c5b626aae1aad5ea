"""One layer step on random inputs, for ``python -m distmoe ab`` and ``profile``.

:func:`join_group` joins ``torch.distributed.run``'s world (NCCL, one GPU per rank) or, in a
plain process, a one-rank gloo group on GPU 0; :func:`draw_inputs` draws a named bench
shape's inputs once and :func:`build_layer` builds a :class:`~distmoe.MoEContext` on them
(with kernel-plan overrides, memory options) and a function that runs one forward
(``mode="fwd"``, under ``no_grad``) or forward+backward step (``"fwdbwd"``: gradients for x,
the scores and both weights through ``torch.autograd.grad``, as the bench takes them);
:func:`layer_step` does both. Every rank runs the shape's T tokens routed over all E
experts and holds its ``E / EP`` local experts' weights, so the per-rank work is the bench's
EP runs'. Routing is sampled by default (each token draws K distinct experts at random: balanced in expectation,
as behind a real router) or exact (``routing="exact"``: every expert gets T*K/E rows, the
bench suite's default histogram).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Joined:
    """The process group a tool runs on: ``group`` (``None`` for the default world), this
    process's ``rank`` of ``world`` and its ``device`` (a CUDA device, or the CPU on a
    machine without CUDA)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    device: torch.device


def join_group() -> Joined:
    """Under ``torch.distributed.run`` (any number of processes, one too): its world over
    NCCL, this rank on GPU ``LOCAL_RANK``. Otherwise a one-rank group over a file store (no
    port to collide with another run; the store's directory goes at exit) on GPU 0. Without
    CUDA: gloo on the CPU (kernels through the Triton interpreter: small shapes only)."""
    import atexit

    from .groups import init_single_process_group, init_torchrun_group, launched_by_torchrun

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    if launched_by_torchrun():
        bench_group, dev = init_torchrun_group(kind)
        return Joined(bench_group.group, bench_group.rank, bench_group.world_size, dev)
    dev = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(dev)
    single = init_single_process_group(dev, backend="gloo")
    atexit.register(single.close)  # the store's directory (and the group, if still up)
    return Joined(None, 0, 1, dev)


def ep1_share(joined: Joined) -> Joined:
    """*Collective* (every rank of ``joined``). A one-rank gloo group for each rank, on the
    same device: a layer built on it with the shape's E / EP experts (:func:`layer_step`'s
    ``share_of``) runs this rank's share of the EP work at EP=1."""
    subgroups = [dist.new_group([r], backend="gloo") for r in range(joined.world)]
    return Joined(subgroups[joined.rank], 0, 1, joined.device)


def add_routing_argument(parser) -> None:
    """``--routing`` of the tools built on :func:`layer_step` (default ``sampled``)."""
    from .workloads import ROUTING_KINDS

    parser.add_argument("--routing", default="sampled", choices=ROUTING_KINDS,
                        help="sampled: each token draws K distinct experts at random "
                             "(default); exact: every expert gets T*K/E rows (the bench "
                             "suite's default)")


@dataclass
class StepInputs:
    """The inputs of one layer step, drawn once (:func:`draw_inputs`) and shared by every
    layer built on them (:func:`build_layer`), so that variants compute the same layer.

    ``shape``: the bench shape (with E / ``share_of`` experts for an EP=1 share); ``tokens``:
    T per rank; ``training``: forward+backward; the tensors on the rank's device: ``ids``,
    ``scores`` (fp32; requiring grad in training), ``x``, ``w13`` and ``w2`` (this rank's
    E / EP experts; requiring grad in training) and the output gradient ``gy``."""

    shape: object
    tokens: int
    training: bool
    ids: torch.Tensor
    scores: torch.Tensor
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    gy: torch.Tensor


def draw_inputs(shape_name: str, mode: str, joined: Joined, *, tokens: int | None = None,
                share_of: int = 1, routing: str = "sampled") -> StepInputs:
    """The inputs of a step of the named bench shape (``tokens`` instead of its T) in
    ``mode`` (``"fwd"`` or ``"fwdbwd"``), drawn with generators seeded by the rank (the
    routing on the host, the rest on the device). ``share_of``: the shape with E /
    ``share_of`` experts (one rank's share of the work at EP = ``share_of``, for a one-rank
    ``joined``). ``routing``: ``"sampled"`` (:func:`~distmoe.reference.random_routing`) or
    ``"exact"`` (:func:`~.workloads.make_routing`'s exact histogram). ValueError for a bad
    argument, before anything is drawn."""
    from distmoe.reference import random_routing

    from .workloads import ROUTING_KINDS, get_shape, make_routing

    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")
    if routing not in ROUTING_KINDS:
        raise ValueError(f"routing must be one of {ROUTING_KINDS}, got {routing!r}")
    from .cli import rank_share

    shape = rank_share(get_shape(shape_name), share_of)
    T, D, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    if tokens is not None:
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        T = tokens
    if E % joined.world:
        raise ValueError(f"EP ({joined.world}) must divide the experts of {shape_name} ({E})")
    E_l, dev = E // joined.world, joined.device
    training = mode == "fwdbwd"
    g = torch.Generator().manual_seed(joined.rank)
    ids, scores = random_routing(T, E, K, generator=g)
    if routing == "exact":  # the same scores, ids with every expert's count T*K/E (+-1)
        ids = make_routing(tokens=T, top_k=K, num_experts=E, seed=joined.rank).expert_ids_TK
    ids, scores = ids.to(dev), scores.to(dev)
    # the dense tensors drawn on the device (DeepSeek-V3's weights are 3.8 G values: minutes
    # on the host)
    gd = torch.Generator(device=dev).manual_seed(joined.rank)

    def draw(*dims, scale=1.0):
        return (torch.randn(*dims, generator=gd, device=dev) * scale).bfloat16()

    x = draw(T, D)
    w13 = draw(E_l, 2, F, D, scale=D**-0.5).requires_grad_(training)
    w2 = draw(E_l, D, F, scale=F**-0.5).requires_grad_(training)
    gy = draw(T, D)
    return StepInputs(shape=shape, tokens=T, training=training, ids=ids,
                      scores=scores.float().requires_grad_(training), x=x, w13=w13, w2=w2,
                      gy=gy)


def build_layer(inputs: StepInputs, joined: Joined, *, overrides: dict | None = None,
                activation_factor: float | None = None, save_gathered_rows: bool = True,
                gathered_rows_in_place: bool | None = None, precision: str = "bf16"
                ) -> tuple[object, Callable[..., None]]:
    """``(ctx, step)``: a :class:`~distmoe.MoEContext` (closed by the caller) for the layer
    of ``inputs`` and a function running one step on them: a forward (under ``no_grad``) or
    forward+backward (gradients for x, the scores and both weights through
    ``torch.autograd.grad``, as the bench takes them). ``step`` reuses the inputs, so it can
    be captured into a CUDA graph. ``step(x_in_buffer=True)`` (inference only) passes x as
    the context's :meth:`~distmoe.MoEContext.input_buffer`, written there once here.

    ``overrides``: the context's kernel-plan overrides (``MoEContext(..., overrides=)``;
    ValueError for one that cannot apply). ``activation_factor``: the context's
    :attr:`~distmoe.MoEConfig.activation_factor` (None: the config's default, every layer
    saves its state; 0: its input only, every layer replays in backward).
    ``save_gathered_rows``: :attr:`~distmoe.MoEConfig.save_gathered_rows` (False: saved
    layers keep their input and the backward gathers the rows again;
    ``gathered_rows_in_place``, with it: :attr:`~distmoe.MoEConfig.gathered_rows_in_place`).
    ``precision``: :attr:`~distmoe.MoEConfig.precision`; an inference step at a low precision
    passes weights prepared once here (:func:`distmoe.prepare_weights`), a training step the
    bf16 weights (the context quantises them once per version).
    """
    import distmoe as dm

    s, T, training = inputs.shape, inputs.tokens, inputs.training
    extra = {} if activation_factor is None else {"activation_factor": activation_factor}
    if not save_gathered_rows:
        extra["save_gathered_rows"] = False
        extra["gathered_rows_in_place"] = gathered_rows_in_place
    cfg = dm.MoEConfig(hidden=s.hidden, ffn=s.ffn, num_experts=s.num_experts, top_k=s.top_k,
                       max_tokens=T, training=training, precision=precision, **extra)
    kw = {} if overrides is None else {"overrides": overrides}
    ctx = dm.MoEContext(cfg, joined.group, device=joined.device, **kw)
    ids, scores, x, w13, w2, gy = (inputs.ids, inputs.scores, inputs.x, inputs.w13, inputs.w2,
                                   inputs.gy)
    if precision != "bf16" and not training:
        w13, w2 = dm.prepare_weights(w13, w2, precision)
    # inference: x also in the context's input buffer, written once (every forward that
    # copies x there writes the same rows)
    x_buf = None if training else ctx.input_buffer(T).copy_(x)

    def step(x_in_buffer: bool = False) -> None:
        if training:
            if x_in_buffer:
                raise ValueError("x_in_buffer: the input buffer is for inference only")
            xs = x.detach().requires_grad_(True)
            y = ctx(xs, ids, scores, w13, w2)
            torch.autograd.grad(y, (xs, scores, w13, w2), gy)
        else:
            with torch.no_grad():
                ctx(x_buf if x_in_buffer else x, ids, scores, w13, w2)

    return ctx, step


def layer_step(shape_name: str, mode: str, joined: Joined, *, tokens: int | None = None,
               share_of: int = 1, routing: str = "sampled",
               activation_factor: float | None = None, save_gathered_rows: bool = True,
               gathered_rows_in_place: bool | None = None, overrides: dict | None = None,
               precision: str = "bf16") -> tuple[object, Callable[..., None], int]:
    """``(ctx, step, T)``: :func:`draw_inputs` then :func:`build_layer` (see both), and the
    tokens per rank. Two calls whose arguments differ in the memory options and
    ``overrides`` only draw the same inputs, so their steps compute the same layer (to
    share one set of inputs, call the two functions)."""
    inputs = draw_inputs(shape_name, mode, joined, tokens=tokens, share_of=share_of,
                         routing=routing)
    ctx, step = build_layer(inputs, joined, overrides=overrides,
                            activation_factor=activation_factor,
                            save_gathered_rows=save_gathered_rows,
                            gathered_rows_in_place=gathered_rows_in_place,
                            precision=precision)
    return ctx, step, inputs.tokens
