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
tensor at a new address gets a new one.

Not used with ``check=True`` (it synchronises), on CPU devices, for training contexts
(their forwards record slot state on the host), inside a CUDA-graph capture of the caller's
(the call is then captured into the caller's graph as it is), or with
``MoEContext(..., graphs=False)``.
"""

from __future__ import annotations

import torch


class ForwardGraphs:
    """The captured inference forwards of one :class:`~distmoe.ops.context.MoEContext`."""

    def __init__(self, ctx, *, max_graphs: int = 256) -> None:
        self.ctx = ctx
        self.max_graphs = max_graphs
        self.pool = None  # one private memory pool for every graph of this context
        self.seen: set = set()  # keys called eagerly once (kernels compiled)
        self.graphs: dict = {}  # key -> (graph, ids, scores)
        self.outputs: dict[int, torch.Tensor] = {}  # T -> static y [T, D]
        self.replays = 0
        self.captures = 0

    def key(self, x, expert_ids, scores, w13, w2) -> tuple:
        return (x.shape[0], expert_ids.dtype, scores.dtype, w13.data_ptr(), w2.data_ptr())

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
        return self.outputs[T].clone()

    def _capture(self, key, T, expert_ids, scores, w13, w2):
        ctx = self.ctx
        ids_s = torch.empty_like(expert_ids)
        scores_s = torch.empty_like(scores)
        if T not in self.outputs:
            self.outputs[T] = torch.empty(T, ctx.cfg.hidden, dtype=torch.bfloat16,
                                          device=ctx.device)
        out = self.outputs[T]
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # The capture records the forward without running it; the caller's stream work so
        # far is ordered before it by torch.cuda.graph's own stream synchronisation.
        with torch.cuda.graph(graph, pool=self.pool):
            ctx.forward_layer(ctx.input_buffer(T), ids_s, scores_s, w13, w2, out=out)
        self.graphs[key] = (graph, ids_s, scores_s)
        self.captures += 1
        return self.graphs[key]

    def clear(self) -> None:
        """Drop every graph (their pool memory returns to torch's caching allocator)."""
        self.graphs.clear()
        self.seen.clear()
        self.outputs.clear()
        self.pool = None

    def stats(self) -> dict:
        return dict(graphs=len(self.graphs), captures=self.captures, replays=self.replays)
