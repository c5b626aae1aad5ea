"""Eager inference calls replayed from CUDA graphs the context captures itself.

A layer call launches a dozen kernels, each through Triton's Python launch path, so an eager
forward costs more host time than a small one takes on the GPU. The layer needs no host
synchronisation, so its forward can be captured once and replayed: :class:`ForwardGraphs`
keeps one CUDA graph per *call key* ``(T, expert_ids dtype, scores dtype, w13 address, w2
address)`` and replays it for every later eager call with that key.

Per call with a captured key: x is copied into the context's input buffer (the dispatch
rows, which the forward reads in place: no copy inside the graph), the ids and scores into
static tensors of the key, the graph is replayed, and y is copied out of the static output
shared by every graph of that T. The first call of a key runs eagerly (it also compiles the
kernels), the second captures and replays. Results are the eager forward's bits: the same
kernels with the same configs on the same values (the per-call choices of the plan depend
on T only, which is part of the key).

Memory: every graph captures into one private pool of the context; the intermediate tensors
of a capture are freed when it ends, so the pool holds about one forward's temporaries plus
one y per distinct T. At most ``max_graphs`` keys get a graph; calls of later keys run
eagerly (no eviction: a stack of more layers than that, each captured again when its turn
came, would pay a capture per call).
Weights are keyed by address: a weight tensor updated in place keeps its graph; a new
tensor at a new address gets a new one. Low-precision inference contexts
(:mod:`distmoe.ops.lowp`) capture their forward the same way, keyed by the prepared weights'
qdata addresses.

**Training** (:class:`TrainingGraphs`): a forward under autograd is keyed by the same call
key plus the slot and the layer's index in it (the slot state a forward appends to), and
its backward by its forward's key. The host part of the slot bookkeeping (the check for a
free layer, the layer's record on the slot's stack, the order check in backward) runs on
every call; the device part (the save/replay decision, the cursors, the kernels) is in the
graphs. A forward's routing tables, slot record, executed ids and fp32 scores are tensors of
its key's graph, read by that key's backward graphs: two live calls never share a key (their
slots or layer indices differ). A backward replays three graphs: up to the W2 DGRAD, the
two weight gradients, and from the W13 DGRAD on. The weight gradients go into new tensors
per call, because autograd keeps them as ``.grad`` (a static output would have to be
copied, a full weight's bytes): their graph is keyed by the new tensors' addresses, which
torch's caching allocator gives again in a steady training loop; a call whose tensors land
elsewhere launches those two kernels eagerly (an address seen twice gets a graph, at most
:attr:`TrainingGraphs.max_weight_graphs` per key; with :attr:`TrainingGraphs.whole_backward`
such an address gets one graph of the whole backward instead, replayed alone). A key's
backward is captured once a
backward of that key ran eagerly (its kernels compiled), from a forward replayed from its
graph. The same bits as the eager calls: the same kernels, configs and values. Memory: the
saved tensors of every captured key stay in the pool (routing tables and the slot record,
about ``T*K*40 + R_cap*40`` bytes per key), plus one x, y, grad_y, grad_x and grad_scores
per distinct T.

Not used with ``check=True`` (it synchronises), on CPU devices, inside a CUDA-graph capture
of the caller's (the call is then captured into the caller's graph as it is), or with
``MoEContext(..., graphs=False)``; a training context's forwards without autograd (no grad
mode, nothing requiring grad) run eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from .autograd import (
    backward_input_grads,
    backward_route_grads,
    backward_weight_grads,
)
from .lowp import lowp_forward
from .lowp_train import (
    fp8_backward_finish,
    fp8_backward_inputs,
    fp8_backward_weights,
    fp8_train_forward,
)


def _address(w) -> int:
    """A weight's address for a graph key: the tensor's, or a prepared low-precision weight's
    qdata (:class:`~distmoe.quant.PreparedWeight`: a new object at a new address gets a new
    graph; one quantised in place keeps its graph)."""
    return (w.qdata if hasattr(w, "qdata") else w).data_ptr()


class GraphPool:
    """One private CUDA-graph memory pool per context, made on first use, and the static
    tensors its graphs read or write that are shared between keys (inputs and outputs per
    T: each is copied in right before a replay or out right after it, in stream order)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._handle = None
        self._statics: dict = {}

    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def static(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The static tensor ``name`` of ``shape`` and ``dtype`` (made once)."""
        key = (name, tuple(shape), dtype)
        t = self._statics.get(key)
        if t is None:
            t = self._statics[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return t

    def clear(self) -> None:
        self._statics.clear()
        self._handle = None


class ForwardGraphs:
    """The captured inference forwards of one :class:`~distmoe.ops.context.MoEContext`."""

    def __init__(self, ctx, pool: GraphPool, *, max_graphs: int = 256) -> None:
        self.ctx = ctx
        self.max_graphs = max_graphs
        self.pool = pool  # one private memory pool for every graph of this context
        self.seen: set = set()  # keys called eagerly once (kernels compiled)
        self.graphs: dict = {}  # key -> (graph, ids, scores)
        self.replays = 0
        self.captures = 0

    def key(self, x, expert_ids, scores, w13, w2) -> tuple:
        return (x.shape[0], expert_ids.dtype, scores.dtype, _address(w13), _address(w2))

    def __call__(self, x, expert_ids, scores, w13, w2) -> torch.Tensor | None:
        """y for this call from a graph (capturing it on the key's second call), or ``None``
        where the caller runs the forward eagerly (first call of a key, T = 0, or inside a
        capture of the caller's own)."""
        T = x.shape[0]
        if T == 0 or torch.cuda.is_current_stream_capturing():
            return None  # nothing to run, or the caller captures a graph of its own
        key = self.key(x, expert_ids, scores, w13, w2)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen or len(self.graphs) >= self.max_graphs:
                self.seen.add(key)
                return None
            entry = self._capture(key, T, expert_ids, scores, w13, w2)
        graph, ids_s, scores_s = entry
        ctx = self.ctx
        buffer = ctx.input_buffer(T)
        if x.data_ptr() != buffer.data_ptr():
            buffer.copy_(x)
        ids_s.copy_(expert_ids)
        scores_s.copy_(scores)
        graph.replay()
        self.replays += 1
        return self.pool.static("y", (T, ctx.cfg.hidden), torch.bfloat16).clone()

    def _capture(self, key, T, expert_ids, scores, w13, w2):
        ctx = self.ctx
        ids_s = torch.empty_like(expert_ids)
        scores_s = torch.empty_like(scores)
        out = self.pool.static("y", (T, ctx.cfg.hidden), torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        # The capture records the forward without running it; the caller's stream work so
        # far is ordered before it by torch.cuda.graph's own stream synchronisation.
        with torch.cuda.graph(graph, pool=self.pool.handle()):
            if ctx._lowp is None:
                ctx.forward_layer(ctx.input_buffer(T), ids_s, scores_s, w13, w2, out=out)
            else:  # a low-precision inference context (prepared weights)
                with torch.no_grad():
                    lowp_forward(ctx, ctx.input_buffer(T), ids_s, scores_s, w13, w2, out=out)
        self.graphs[key] = (graph, ids_s, scores_s)
        self.captures += 1
        return self.graphs[key]

    def clear(self) -> None:
        """Drop every graph (their pool memory returns to torch's caching allocator)."""
        self.graphs.clear()
        self.seen.clear()

    def stats(self) -> dict:
        return dict(graphs=len(self.graphs), captures=self.captures, replays=self.replays)


@dataclasses.dataclass
class _Forward:
    """One captured training forward: its graph, static inputs, and the saved state its
    backward reads (tensors of the graph; the record's host fields are copied per call)."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    scores: torch.Tensor
    saved: dict
    record: object  # the LayerRecord template (distmoe.ops.activations)


@dataclasses.dataclass
class _Backward:
    """One key's captured backward: up to the W2 DGRAD, and from the W13 DGRAD on; with
    :attr:`TrainingGraphs.whole_backward`, whole backwards per weight-gradient outputs."""

    route_grads: torch.cuda.CUDAGraph
    input_grads: torch.cuda.CUDAGraph
    weight_grads: dict = dataclasses.field(default_factory=dict)  # out addresses -> graph
    weight_seen: set = dataclasses.field(default_factory=set)  # out addresses launched once
    whole: dict = dataclasses.field(default_factory=dict)  # out addresses -> whole backward


def _out_key(grad_w13, grad_w2) -> tuple:
    """The weight-gradient outputs' addresses (a graph writes to the addresses it captured)."""
    return tuple(None if t is None else (t.data_ptr(), t.dtype) for t in (grad_w13, grad_w2))


class TrainingGraphs:
    """The captured training forwards and backwards of one training
    :class:`~distmoe.ops.context.MoEContext` (module docstring, **Training**)."""

    #: weight-gradient graphs per key (one per pair of output addresses)
    max_weight_graphs = 4
    #: Where the weight-gradient outputs come at an address seen before, replay one graph
    #: of the whole backward (its three parts captured together) instead of three: two
    #: graph launches fewer per call (issue 66's host time). Off until a GPU run measures
    #: it; the same kernels and bits either way.
    whole_backward = False

    def __init__(self, ctx, pool: GraphPool, *, max_graphs: int = 256) -> None:
        self.ctx = ctx
        self.pool = pool
        self.max_graphs = max_graphs
        self.seen: set = set()  # keys whose forward ran eagerly once
        self.backward_seen: set = set()  # keys whose backward ran eagerly once
        self.forwards: dict = {}  # key -> _Forward
        self.backwards: dict = {}  # key -> _Backward
        self.replays = 0
        self.captures = 0

    def key(self, x, expert_ids, scores, w13, w2) -> tuple | None:
        """The graph key, or None (run eagerly) where the host does not know the selected
        slot and its depth: a key must never name two live layers, whose records would share
        the graph's tensors."""
        acts = self.ctx.activations
        depth = None if acts.slot is None else acts.host_depth(acts.slot)
        if depth is None:
            return None
        return (x.shape[0], expert_ids.dtype, scores.dtype, w13.data_ptr(), w2.data_ptr(),
                acts.slot, depth)

    def forward(self, x, expert_ids, scores, w13, w2):
        """``(y, saved)`` of a forward under autograd (see
        :meth:`~distmoe.ops.context.MoEContext.forward_layer`), from the key's graph (captured
        on the key's second call) or eagerly. ``saved`` also names the key and whether the
        graph ran (``graph_key``, ``graphed``)."""
        ctx = self.ctx
        T = x.shape[0]
        key = self.key(x, expert_ids, scores, w13, w2)
        if key is None:  # selected on the device: eager
            y, saved = ctx.forward_layer(x, expert_ids, scores, w13, w2, save=True)
            return y, dict(saved, graph_key=None, graphed=False)
        entry = self.forwards.get(key)
        if entry is None:
            if (torch.cuda.is_current_stream_capturing() or key not in self.seen
                    or len(self.forwards) >= self.max_graphs):
                self.seen.add(key)
                y, saved = ctx.forward_layer(x, expert_ids, scores, w13, w2, save=True)
                return y, dict(saved, graph_key=key, graphed=False)
            entry = self._capture_forward(key, T, expert_ids, scores, w13, w2)
        elif torch.cuda.is_current_stream_capturing():
            y, saved = ctx.forward_layer(x, expert_ids, scores, w13, w2, save=True)
            return y, dict(saved, graph_key=None, graphed=False)
        acts = ctx.activations
        acts.check_room()  # before anything is written
        self.pool.static("x", (T, ctx.cfg.hidden), torch.bfloat16).copy_(x)
        entry.ids.copy_(expert_ids)
        entry.scores.copy_(scores)
        entry.graph.replay()
        self.replays += 1
        rec = dataclasses.replace(entry.record)  # a live record of this call, same tensors
        acts.push(rec)
        y = self.pool.static("y", (T, ctx.cfg.hidden), torch.bfloat16).clone()
        return y, dict(entry.saved, record=rec, graph_key=key, graphed=True)

    def _capture_forward(self, key, T, expert_ids, scores, w13, w2) -> _Forward:
        ctx = self.ctx
        acts = ctx.activations
        D = ctx.cfg.hidden
        x_s = self.pool.static("x", (T, D), torch.bfloat16)
        y_s = self.pool.static("y", (T, D), torch.bfloat16)
        ids_s = torch.empty_like(expert_ids)
        scores_s = torch.empty_like(scores)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle()):
            _, saved = ctx.forward_layer(x_s, ids_s, scores_s, w13, w2, save=True, out=y_s)
        # The capture ran nothing: the layer it appended is not in the slot yet.
        rec = saved["record"]
        acts.forget(rec)
        entry = _Forward(graph=graph, ids=ids_s, scores=scores_s, saved=saved, record=rec)
        self.forwards[key] = entry
        self.captures += 1
        return entry

    def backward(self, saved: dict, grad_y: torch.Tensor, w13, w2, x_shape, weight_out):
        """The backward of a forward that ran from its graph, from the key's backward graphs
        (see :func:`distmoe.ops.autograd.backward_eager` for the result), or ``None`` where
        the caller runs it eagerly (the forward ran eagerly, the key's first backward, or
        inside a capture of the caller's)."""
        key = saved.get("graph_key")
        if key is None or torch.cuda.is_current_stream_capturing():
            return None
        entry = self.backwards.get(key)
        if entry is None:
            if not saved["graphed"] or key not in self.backward_seen:
                self.backward_seen.add(key)
                return None
            entry = self._capture_backward(key, saved, w13, w2, x_shape)
        T, K = saved["ids_executed"].shape
        D = self.ctx.cfg.hidden
        self.pool.static("grad_y", (T, D), torch.bfloat16).copy_(grad_y)
        wkey = _out_key(*weight_out)
        whole = entry.whole.get(wkey)
        if (whole is None and self.whole_backward and wkey in entry.weight_seen
                and len(entry.whole) < self.max_weight_graphs):
            whole = entry.whole[wkey] = self._capture_whole(saved, w13, w2, weight_out)
        if whole is not None:
            whole.replay()
        else:
            entry.route_grads.replay()
            self._weight_grads(entry, saved, *weight_out)
            entry.input_grads.replay()
        self.replays += 1
        grad_x = self.pool.static("grad_x", (T, D), torch.bfloat16).clone()
        grad_scores = self.pool.static("grad_scores", (T, K), torch.float32).clone()
        return grad_x.view(x_shape), grad_scores

    def _weight_grads(self, entry: _Backward, saved: dict, grad_w13, grad_w2) -> None:
        """:func:`~distmoe.ops.autograd.backward_weight_grads` into these outputs: from the
        graph of their addresses, captured when the addresses come a second time, else
        launched eagerly."""
        wkey = _out_key(grad_w13, grad_w2)
        graph = entry.weight_grads.get(wkey)
        if graph is None:
            if (wkey not in entry.weight_seen
                    or len(entry.weight_grads) >= self.max_weight_graphs):
                entry.weight_seen.add(wkey)
                backward_weight_grads(self.ctx, saved, grad_w13, grad_w2)
                return
            graph = self._capture(
                lambda: backward_weight_grads(self.ctx, saved, grad_w13, grad_w2))
            entry.weight_grads[wkey] = graph
            self.captures += 1
        graph.replay()

    def _capture(self, *parts) -> torch.cuda.CUDAGraph:
        """One graph of ``parts()`` in order, in the context's pool (autograd runs backward
        on a worker thread: capture errors stay on this thread)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle(),
                              capture_error_mode="thread_local"):
            for part in parts:
                part()
        return graph

    def _backward_parts(self, saved, w13, w2) -> tuple:
        """The backward before and after the weight gradients, on the static grad_y (in) and
        grad_x, grad_scores (out) of the call's token count."""
        ctx = self.ctx
        T, K = saved["ids_executed"].shape
        D = ctx.cfg.hidden
        grad_y = self.pool.static("grad_y", (T, D), torch.bfloat16)
        grad_x = self.pool.static("grad_x", (T, D), torch.bfloat16)
        grad_scores = self.pool.static("grad_scores", (T, K), torch.float32)
        return (lambda: backward_route_grads(ctx, saved, w13, w2, grad_y),
                lambda: backward_input_grads(ctx, saved, w13, grad_x, grad_scores))

    def _capture_backward(self, key, saved, w13, w2, x_shape) -> _Backward:
        route, inputs = self._backward_parts(saved, w13, w2)
        entry = self.backwards[key] = _Backward(route_grads=self._capture(route),
                                                input_grads=self._capture(inputs))
        self.captures += 1
        return entry

    def _capture_whole(self, saved, w13, w2, weight_out) -> torch.cuda.CUDAGraph:
        """The three parts of a backward (:meth:`_capture_backward`'s two and the weight
        gradients into ``weight_out``) captured as one graph on the same static tensors."""
        route, inputs = self._backward_parts(saved, w13, w2)
        self.captures += 1
        return self._capture(
            route, lambda: backward_weight_grads(self.ctx, saved, *weight_out), inputs)

    def clear(self) -> None:
        """Drop every graph (their pool memory returns to torch's caching allocator)."""
        self.forwards.clear()
        self.backwards.clear()
        self.seen.clear()
        self.backward_seen.clear()

    def stats(self) -> dict:
        return dict(forward_graphs=len(self.forwards), backward_graphs=len(self.backwards),
                    weight_graphs=sum(len(b.weight_grads) for b in self.backwards.values()),
                    whole_backward_graphs=sum(len(b.whole) for b in self.backwards.values()),
                    captures=self.captures, replays=self.replays)


class _FP8Entry:
    """One captured FP8 training forward (one instance of its key: its saved state belongs
    to one live call at a time) and, once captured, its backward graphs."""

    graph: torch.cuda.CUDAGraph
    pool: object  # its own memory pool (graph_pool_handle)
    tw: object  # the TrainWeights the graph reads (kept alive: the key holds its id)
    x: torch.Tensor
    ids: torch.Tensor
    scores: torch.Tensor
    y: torch.Tensor
    saved: dict
    busy: bool = False
    backward: tuple | None = None  # (inputs graph, finish graph, parts)
    backward_seen: bool = False
    grad_y: torch.Tensor  # the backward graphs' static input and outputs
    grad_x: torch.Tensor
    grad_scores: torch.Tensor


class _Lease:
    """Marks an :class:`_FP8Entry` in use from its forward's replay until the call's saved
    state goes (its backward ran, or autograd freed the graph of a dropped output)."""

    __slots__ = ("entry",)

    def __init__(self, entry: _FP8Entry) -> None:
        self.entry = entry
        entry.busy = True

    def __del__(self) -> None:
        self.entry.busy = False


class FP8TrainGraphs:
    """The captured calls of an FP8 training :class:`~distmoe.ops.context.MoEContext`
    (``precision="mxfp8" | "fp8_block"``, :mod:`distmoe.ops.lowp_train`).

    A forward under autograd is keyed by ``(T, ids dtype, scores dtype, the weights' quantised
    forms)`` (:func:`~distmoe.ops.lowp_train.train_weights` keeps those in the same tensors
    across weight versions, so an optimizer step keeps the key). A key's first call runs
    eagerly (it compiles the kernels); from its second on the forward replays a graph that
    writes its saved state (routing tables, h1, the owner's h3 rows, the weight gradient's x)
    into tensors of that graph. One graph serves one live call: while a call's state is held
    (its backward has not run), another call of the key takes another instance of the graph,
    captured on demand (at most :attr:`max_instances` per key; later ones run eagerly). A
    call's backward replays two graphs of its instance, before and after the weight
    gradients, and launches the weight gradients in between (their outputs are new tensors
    each call, or the ``main_grad`` buffers); an instance's first backward runs eagerly and
    captures them. The same kernels on the same values as the eager calls: the same bits.

    Memory: each instance has a memory pool of its own, holding its saved state (about
    ``R (D + 4F)`` bytes plus ``2 T K D`` for the h3 rows, at the receive bound R) and its
    forward's and backward's temporaries. Own pools because instances replay in any order
    while another instance's state is live: in a shared pool a capture may place its live
    state in memory an earlier capture freed, which that earlier graph's replay overwrites.
    An instance's own graphs always run in order (forward, backward, forward, ...), so they
    share its pool. An instance also keeps the quantised weights it reads alive (the key
    holds their object's id), at most :attr:`max_instances` per key and ``max_graphs`` in
    all.
    Not used with ``check=True``, on CPU devices, inside a capture of the caller's, or with
    ``graphs=False``; forwards without autograd run eagerly.
    """

    #: graph instances per key (live calls of one key at once)
    max_instances = 4

    def __init__(self, ctx, pool: GraphPool, *, max_graphs: int = 64) -> None:
        self.ctx = ctx
        self.pool = pool
        self.max_graphs = max_graphs
        self.forwards: dict = {}  # key -> [_FP8Entry]
        self.seen: set = set()
        self.replays = 0
        self.captures = 0

    def forward(self, x, expert_ids, scores, tw):
        """``(y, saved)`` of :func:`~distmoe.ops.lowp_train.fp8_train_forward`, replayed where
        the key has a free instance (``saved["entry"]`` names it, with the lease that keeps
        it), else eagerly."""
        ctx = self.ctx
        if not torch.cuda.is_current_stream_capturing():
            key = (x.shape[0], expert_ids.dtype, scores.dtype, id(tw))
            entries = self.forwards.setdefault(key, [])
            entry = next((e for e in entries if not e.busy), None)
            if (entry is None and key in self.seen and len(entries) < self.max_instances
                    and sum(map(len, self.forwards.values())) < self.max_graphs):
                entry = self._capture_forward(entries, x, expert_ids, scores, tw)
            if entry is not None:
                entry.x.copy_(x)
                entry.ids.copy_(expert_ids)
                entry.scores.copy_(scores)
                entry.graph.replay()
                self.replays += 1
                return entry.y.clone(), dict(entry.saved, entry=entry, lease=_Lease(entry))
            self.seen.add(key)
        return fp8_train_forward(ctx, x, expert_ids, scores, tw)

    def _capture_forward(self, entries, x, expert_ids, scores, tw) -> _FP8Entry:
        entry = _FP8Entry()
        entry.tw = tw
        entry.x, entry.ids, entry.scores = (torch.empty_like(t) for t in (x, expert_ids, scores))
        entry.graph = torch.cuda.CUDAGraph()
        entry.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(entry.graph, pool=entry.pool):
            entry.y, entry.saved = fp8_train_forward(self.ctx, entry.x, entry.ids,
                                                     entry.scores, tw)
        entries.append(entry)
        self.captures += 1
        return entry

    def backward(self, saved: dict, grad_y: torch.Tensor, weight_out):
        """``(grad_x, grad_scores)`` of a replayed forward's backward from its instance's
        graphs, the weight gradients launched between them; ``None`` where the caller runs
        the eager backward (the forward ran eagerly, or inside a capture of the caller's).
        The instance's first backward captures its graphs."""
        entry = saved.get("entry")
        if entry is None or torch.cuda.is_current_stream_capturing():
            return None
        ctx = self.ctx
        T, K = saved["ids_executed"].shape
        if entry.backward is None:
            if not entry.backward_seen:  # the first backward of this instance: eager
                entry.backward_seen = True
                return None
            entry.grad_y = torch.empty(T, ctx.cfg.hidden, dtype=torch.bfloat16,
                                       device=ctx.device)
            entry.grad_x = torch.empty_like(entry.grad_y)
            entry.grad_scores = torch.empty(T, K, dtype=torch.float32, device=ctx.device)
            # autograd runs backward on a worker thread: capture errors stay on this thread
            inputs = torch.cuda.CUDAGraph()
            with torch.cuda.graph(inputs, pool=entry.pool,
                                  capture_error_mode="thread_local"):
                parts = fp8_backward_inputs(ctx, entry.saved, entry.grad_y, entry.grad_scores)
            finish = torch.cuda.CUDAGraph()
            with torch.cuda.graph(finish, pool=entry.pool,
                                  capture_error_mode="thread_local"):
                fp8_backward_finish(ctx, entry.saved, entry.grad_x)
            entry.backward = (inputs, finish, parts)
            self.captures += 1
        inputs, finish, parts = entry.backward
        entry.grad_y.copy_(grad_y)
        inputs.replay()
        fp8_backward_weights(ctx, entry.saved, parts, weight_out)
        finish.replay()
        self.replays += 1
        return entry.grad_x.clone(), entry.grad_scores.clone()

    def clear(self) -> None:
        """Drop every graph (their pool memory returns to torch's caching allocator)."""
        self.forwards.clear()
        self.seen.clear()

    def stats(self) -> dict:
        entries = [e for es in self.forwards.values() for e in es]
        return dict(forward_graphs=len(entries),
                    backward_graphs=sum(e.backward is not None for e in entries),
                    captures=self.captures, replays=self.replays)
