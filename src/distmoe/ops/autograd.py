"""Autograd for :class:`distmoe.ops.MoEContext` (training).

What it reads of the context is declared there: ``plan`` (the kernel configs),
``backward_buffers`` (:class:`~distmoe.ops.context.BackwardBuffers`), ``forward_layer``,
``gather_table``, ``check_open``, ``activations``, ``heap``, ``cfg``, ``num_local_experts``
and ``device``; nothing private.

Forward (same barriers as inference, see :mod:`distmoe.ops.context`): the layer's state goes
to the selected slot of the context's activation buffer (:mod:`distmoe.ops.activations`):
a *saved* layer keeps its gathered rows ``x_rows [R, D]``, ``h1 [R, 2F]`` and its returned
route results ``h3 [T_max*K, D]``; a *replayed* layer keeps only its input ``x [T, D]``. The
device decides which (worst rank's rows), so the host never waits. Per call, the autograd ctx
keeps the routing tables, the slot record (slot id, layer index, cursors, offsets), the
executed ids (others -1), fp32 scores and the weights.

Backward is **collective**: every rank must run the backward of the same calls in the same
order, and the layers of a slot in reverse order of their forwards. Per call:

    0. rewind the slot cursor to where the forward started
    (replay steps, skipped entirely when the slot is large enough for every layer to save
     its gathered rows; otherwise launched always and turned off on the device for layers
     that kept their rows)
    r1. owner: copy the kept x back into its dispatch rows 0..T-1
    r2. barrier                    (republished x visible)
    r3. expert: W13 again into scratch (xs, h1g, h2). W2 is not rerun: the backward needs
        no h3, since the experts compute the score gradients (step 3). A saved layer that
        kept x instead of its rows (``cfg.save_gathered_rows`` False) runs r1 and r2 too,
        then only gathers its rows into scratch xs (regather_rows), the same bits (with
        ``"auto"``, a layer that chose to keep x; a device predicate turns the gather off
        for the others); at EP = 1 with ``False`` it runs none of r1-r3: its W13 WGRAD
        reads x's rows in place, through the forward's gather table moved onto the kept x
        (``w13_wgrad(x_rows=...)``), and a replayed layer's W13 stores h1 only (in place
        where :func:`distmoe.memory.rows_in_place`)
    1. owner:  push_route_grads: bf16(grad_y[t]) of every executed route, unscaled, is pushed
               straight into the expert's scratch gh3, at the activation row the expert
               executes the route at (tables.dest_rows_TK; the activation buffer is a heap
               allocation, so peers can write it); score[t,k] goes, as an fp32, to the start
               of the owner's own combine row t*K+k
    2. barrier                     (route output gradients and scores visible to the experts)
    3. expert: w2_dgrad_swiglu_bwd (scored_rows) reads the grad_y rows from scratch gh3
               (nothing to gather), each route's score through its combine-row address
               (tables.scatter_ptrs) and h1 (slot or scratch h1g); it writes
               grad_h1 = SwiGLU'(score * (grad_y @ W2)) into scratch h1g (in place over a
               replayed h1) and bf16(score * h2) into scratch h2, and leaves the route's
               score gradient as fp32 parts dot(grad_y @ W2, h2), one per column tile, in the
               owner's combine row after the score (their sum is <grad_y[t], h3[t,k]> before
               h3's rounding to bf16);
               w2_wgrad (grad_y rows x score*h2) and w13_wgrad accumulate fp32 weight
               gradients (x_rows from the slot or scratch xs); w13_dgrad_scatter stores each
               route's input gradient into the owner's dispatch row t*K+k
               (tables.bwd_scatter_ptrs)
    4. barrier                     (all route input gradients and score parts have landed)
    5. owner:  reduce_routes: grad_x[t] = bf16(sum_k dispatch[t*K+k]) over executed routes,
               and grad_scores[t,k] = the sum of the route's parts, in order

Why the experts compute the score gradients: the owner no longer reads the saved h3 rows
(``T*K*D*2`` bytes) and a replayed layer's backward no longer reruns W2 and its barrier, for a
W2 DGRAD epilogue that does more per element (evidence: docs/performance.md). The saved h3
rows are read only by the forward's combine.

Why the peer writes are safe:

* r1 writes this rank's dispatch rows; their last readers were this rank's step 5 of the
  previous backward (same stream) and peers' gathers of earlier calls, finished before
  barriers this rank has passed. r3's gathers read those rows and finish (same stream)
  before this rank enters barrier 2, which every rank passes before any step 3 scatter
  writes dispatch rows again.
* step 1 writes peers' scratch gh3 rows. Only step 3 reads them (W2 DGRAD and WGRAD, on the
  expert, after barrier 2); the previous readers (step 3 of the previous backward) finished
  before that backward's barrier 4, which every rank passes before this backward began. No
  other kernel touches scratch gh3 (the replay's r3 writes xs, h1g and h2 only).
* step 1 also writes the owner's own combine rows (scores). Their previous readers were
  the owner's combine in forward (same stream) and peers' step 3 of the previous backward
  (before its barrier 4). Peers read the scores and write the parts in step 3, between
  barriers 2 and 4; the owner reads the parts in step 5, after barrier 4. The next writers
  are peers' W2 scatters of a later forward, after barriers this rank enters only after
  its step 5.
* step 3's scatter writes peers' dispatch rows. Peers read their dispatch in forward (the
  W13 gather, finished before the forward's second barrier), in r3 (before barrier 2) and in
  step 5 of the previous backward (finished before they entered barrier 2 of this one).
* No barrier after step 5: the only reader of this rank's dispatch in step 5 is this rank,
  and the next write into it is either this rank's own publish or r1 (ordered after step 5
  on the same stream) or a peer's write after a later barrier, which this rank enters only
  after its step 5.

torch.utils.checkpoint: with ``use_reentrant=True`` the checkpointed forward runs without
grad (nothing enters a slot) and the recomputation in backward appends the layer to the
slot selected *at that time*, right before its own backward (select the layer's slot again
before backward if a pipeline schedule moved on). With ``use_reentrant=False`` this function
saves no tensors through autograd, so a region holding only MoE calls is not recomputed and
keeps its slot state. A non-reentrant region where a tensor-saving op follows the MoE call
re-runs the MoE forward during backward: an extra collective forward whose layer lands on top
of the original one, whose backward then fails (RuntimeError: reverse order; a ValueError if
the slot is full); ``reset_slots`` on every rank recovers. Use the reentrant variant, or
checkpoint the MoE call alone.

In-place changes between a layer's forward and its backward: to scores, w13 or w2 raise a
RuntimeError in the backward (versions compared by hand, since these tensors are not saved
through autograd); to x, none (its rows were copied into the activation buffer). The
backward is ``once_differentiable``: ``create_graph=True`` through it raises instead of
losing the second-order terms.

Forwards whose outputs are dropped without a backward keep their layer in the slot until
``ctx.reset_slots()`` (on every rank): releasing them when Python frees the graph would
happen at a different moment on each rank and split the ranks' save/replay decisions.

Returned gradients: x (bf16), scores (scores' dtype), w13 and w2 in the parameters' dtype
(bf16: the WGRAD kernels accumulate in fp32 and round once when they store; autograd adds
them into ``.grad``). With ``MoEContext(main_grad=True)`` the WGRAD kernels add the fp32
weight gradients into ``w13.main_grad`` and ``w2.main_grad`` instead (Megatron's gradient
accumulation fusion: no bf16 rounding between micro-batches) and return none for the
weights. Weight gradients that no input needs are not computed.
Routes beyond the receive bound are not executed: they get zero gradients everywhere. Saved
and replayed layers run the same kernels on the same values, so their gradients are
bit-identical (the score parts are summed in a fixed order: no atomics).
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.function import once_differentiable

from ..kernels.movement.offset_copy import offset_copy
from ..kernels.movement.regather_rows import regather_rows
from ..kernels.movement.route_grad import push_route_grads, reduce_routes
from ..kernels.w2_dgrad.triton import w2_dgrad_swiglu_bwd
from ..kernels.w13_dgrad.triton import w13_dgrad_scatter
from ..kernels.w13_forward.triton import gather_w13_swiglu
from ..kernels.wgrad.triton import w2_wgrad, w13_wgrad


class MoEFunction(torch.autograd.Function):
    """``y = MoEFunction.apply(moe_ctx, x, expert_ids, scores, w13, w2)`` (collective)."""

    @staticmethod
    def forward(ctx, moe, x, expert_ids, scores, w13, w2):
        # the context's own CUDA graphs replay it where they can (distmoe.ops.graphs)
        y, saved = moe.training_forward(x, expert_ids, scores, w13, w2)
        ctx.moe = moe
        # Plain attributes, not save_for_backward: the layer's state lives in the activation
        # buffer, and a non-reentrant torch.utils.checkpoint around this call must not re-run
        # it (a re-run would append to the slot during backward).
        ctx.saved = saved
        ctx.record = saved["record"]  # the layer's slot record (tools and tests read it)
        ctx.record.owner = weakref.ref(ctx)  # reset_slots refuses while this graph lives
        ctx.scores_dtype = scores.dtype
        ctx.weights = (w13, w2)
        # ... so autograd's check of saved tensors' versions does not run: done by hand here
        # (the tensors the backward reads; x's rows are in the activation buffer already)
        record_versions(ctx, scores, w13, w2)
        ctx.x_shape = tuple(x.shape)
        return y

    @staticmethod
    @once_differentiable  # its kernels build no graph: create_graph=True would lose terms
    def backward(ctx, grad_y):
        moe = ctx.moe
        moe.check_open()
        check_versions(ctx)
        saved = ctx.saved
        moe.activations.end_layer(saved["record"], restore=False)  # 0. checks the order
        w13, w2 = ctx.weights
        weight_out = weight_grad_outputs(ctx, moe)
        grad_x, grad_scores = moe.training_backward(saved, grad_y, w13, w2, ctx.x_shape,
                                                    weight_out)
        return backward_outputs(ctx, moe, grad_x, grad_scores, weight_out)


def weight_grad_outputs(ctx, moe):
    """Where a layer backward writes its weight gradients, ``(grad_w13, grad_w2)`` (each
    None where not needed): new tensors autograd keeps as ``.grad``, or the weights'
    ``main_grad`` buffers (``MoEContext(main_grad=True)``). ``ctx.weights`` holds the
    weights."""
    need = ctx.needs_input_grad
    w13, w2 = ctx.weights
    if moe.main_grad:
        return (w13.main_grad if need[4] else None, w2.main_grad if need[5] else None)
    return new_weight_grads(w13, w2, need_w13=need[4], need_w2=need[5])


def backward_outputs(ctx, moe, grad_x, grad_scores, weight_out) -> tuple:
    """The gradients a layer function's backward returns for ``(moe, x, expert_ids, scores,
    w13, w2)``: none for the weights with ``main_grad`` (added into their buffers); the
    score gradient in the scores' dtype (``ctx.scores_dtype``)."""
    need = ctx.needs_input_grad
    grad_w13, grad_w2 = (None, None) if moe.main_grad else weight_out
    return (None, grad_x if need[1] else None, None,
            grad_scores.to(ctx.scores_dtype) if need[3] else None, grad_w13, grad_w2)


def record_versions(ctx, scores, w13, w2) -> None:
    """Keep the version counters of the tensors a backward reads but autograd does not save
    (the layer's state lives in its own buffers), for :func:`check_versions`."""
    ctx.inputs = (scores, w13, w2)
    ctx.versions = tuple(t._version for t in ctx.inputs)


def check_versions(ctx) -> None:
    """RuntimeError where scores, w13 or w2 changed in place since the forward
    (:func:`record_versions`): their gradients would mix old and new values."""
    for name, t, before in zip(("scores", "w13", "w2"), ctx.inputs, ctx.versions, strict=True):
        if t._version != before:
            raise RuntimeError(
                f"MoE layer backward: {name} was modified in place after the layer's "
                f"forward (tensor version {before} then, {t._version} now), so its "
                "gradients would mix old and new values; modify a copy, or run the "
                "forward again after the change")


def backward_route_grads(moe, saved: dict, w13, w2, grad_y: torch.Tensor) -> None:
    """Steps 0 (the cursor rewind on the device), r1-r3 and 1-3 up to the W2 DGRAD (module
    docstring): after it, scratch ``h1g`` holds grad_h1, ``h2`` score * h2 and ``gh3`` the
    route output gradients that the weight gradients read. ``grad_y``: bf16 [T, D],
    contiguous. Device work only (captured whole by :mod:`distmoe.ops.graphs`)."""
    acts = moe.activations
    rec, tables = saved["record"], saved["tables"]
    acts.restore_cursor(rec)
    ids_executed, scores_f32 = saved["ids_executed"], saved["scores_f32"]
    heap = moe.heap
    cfg = moe.cfg
    T, K = ids_executed.shape
    D = cfg.hidden
    po, ro = tables.padded_offsets, tables.row_offsets
    elements = acts.elements
    scratch = acts.scratch
    bufs = moe.backward_buffers
    # device predicates of the forward's decision: replayed; saved with x kept instead
    # of its rows; either (:mod:`distmoe.kernels.movement.slot_cursor`)
    replayed, regather, rebuild = rec.flags[0:1], rec.flags[1:2], rec.flags[2:3]

    reads_x = acts.rows_in_place  # EP = 1 and regathers: W13 WGRAD reads x in place
    if not acts.always_saves or (acts.may_regather and not reads_x):
        # r1-r3: rebuild a replayed layer's state (every kernel is off on the device for a
        # layer that kept its rows; the barrier runs either way so that all ranks stay
        # paired). With regathers every layer kept x: the table is needed either way.
        offset_copy(bufs.dispatch, elements, T * D, src_offset=rec.offsets[3:4])
        heap.barrier()
        gather_ptrs = moe.gather_table(tables.gather_ptrs,
                                        None if acts.regathers else rebuild)
        if acts.may_regather and not reads_x:
            regather_rows(gather_ptrs, po, ro, scratch["xs"], block_m=cfg.row_block,
                          enable=regather)
        if not acts.always_saves:
            gather_w13_swiglu(gather_ptrs, po, ro, w13, scratch["h2"], h1_out=elements,
                              x_out=elements, out_offsets=bufs.replay_offsets,
                              enable=replayed, config=moe.plan.w13)
    # 1. owner: unscaled route output gradients pushed into the experts' gh3 rows, the
    #    scores into its own combine rows
    push_route_grads(grad_y, ids_executed, scores_f32, bufs.combine[:T * K],
                     dest_rows=tables.dest_rows_TK, dest_bases=bufs.gh3_bases,
                     experts_per_rank=moe.num_local_experts)
    # 2. route output gradients and scores visible to the experts
    heap.barrier()
    # 3. expert side (the score parts go into the owners' combine rows); h1 where the
    #    forward left it, saved or rebuilt
    w2_dgrad_swiglu_bwd(tables.scatter_ptrs, po, ro, w2, elements, scratch["h1g"],
                        h1_offset=rec.backward[1:2], h2_out=scratch["h2"],
                        grad_h3_rows=scratch["gh3"], scored_rows=True,
                        config=moe.plan.w2_dgrad)


def backward_weight_grads(moe, saved: dict, grad_w13: torch.Tensor | None,
                          grad_w2: torch.Tensor | None) -> None:
    """Step 3's weight gradients, after :func:`backward_route_grads`, into ``grad_w13``
    [E_local, 2, F, D] and ``grad_w2`` [E_local, D, F] (each skipped where ``None``). With
    ``moe.main_grad`` added into them (fp32 buffers, the weights' ``main_grad``), else written
    whole in the weights' dtype: fp32 accumulation, one rounding straight into the output
    (one program per output tile writes it whole: no zero fill, no conversion pass); those
    are new tensors per call (:func:`new_weight_grads`) because autograd keeps them as
    ``.grad``. Device work only."""
    acts = moe.activations
    rec, tables = saved["record"], saved["tables"]
    po, ro = tables.padded_offsets, tables.row_offsets
    scratch = acts.scratch
    if grad_w2 is not None:
        w2_wgrad(scratch["gh3"], scratch["h2"], po, ro, grad_w2, accumulate=moe.main_grad,
                 config=moe.plan.w2_wgrad)
    if grad_w13 is not None:
        # x's rows: in order at rec.backward[2] (slot or scratch xs), or read in place
        # through the table where the layer kept x (acts.rows_in_place)
        x_offset, x_rows = rec.backward[2:3], None
        if acts.rows_in_place:
            x_offset, x_rows = rec.backward[3:5], tables.gather_ptrs
        w13_wgrad(scratch["h1g"], acts.elements, po, ro, grad_w13, x_offset=x_offset,
                  accumulate=moe.main_grad, config=moe.plan.w13_wgrad, x_rows=x_rows,
                  rows_origin=moe.backward_buffers.table_origin)  # 0 unless in place


def new_weight_grads(w13, w2, *, need_w13: bool, need_w2: bool):
    """``(grad_w13, grad_w2)``: new uninitialised tensors of the weights' shapes and dtypes
    (``None`` where not needed) for :func:`backward_weight_grads`."""
    return (torch.empty_like(w13, memory_format=torch.contiguous_format) if need_w13 else None,
            torch.empty_like(w2, memory_format=torch.contiguous_format) if need_w2 else None)


def backward_input_grads(moe, saved: dict, w13, grad_x: torch.Tensor,
                         grad_scores: torch.Tensor) -> None:
    """The rest of step 3 and steps 4-5: every route's input gradient into its owner's
    dispatch row, the barrier, then ``grad_x`` bf16 [T, D] and ``grad_scores`` fp32 [T, K]
    written (every element). Device work only."""
    tables = saved["tables"]
    ids_executed = saved["ids_executed"]
    T, K = ids_executed.shape
    bufs = moe.backward_buffers
    # Route input gradients into the owners' dispatch rows t*K+k (see the module docstring
    # for why no peer reads dispatch now).
    w13_dgrad_scatter(moe.activations.scratch["h1g"], tables.padded_offsets,
                      tables.row_offsets, w13, tables.bwd_scatter_ptrs,
                      config=moe.plan.w13_dgrad)
    # 4. all route input gradients have landed
    moe.heap.barrier()
    # 5. owner: sum its routes' input gradients and score parts (no barrier after: module
    #    docstring)
    reduce_routes(bufs.dispatch[:T * K], ids_executed, grad_x, score_rows=bufs.combine[:T * K],
                  score_parts=bufs.score_parts, grad_scores_out=grad_scores)


def backward_eager(moe, saved: dict, grad_y: torch.Tensor, w13, w2, x_shape, weight_out):
    """The whole backward of one call, launched kernel by kernel: ``(grad_x bf16 [T, D],
    grad_scores fp32 [T, K])``, the weight gradients into ``weight_out`` (a pair for
    :func:`backward_weight_grads`)."""
    grad_y = grad_y.to(torch.bfloat16).contiguous()
    backward_route_grads(moe, saved, w13, w2, grad_y)
    backward_weight_grads(moe, saved, *weight_out)
    grad_x = torch.empty(x_shape, dtype=torch.bfloat16, device=moe.device)
    grad_scores = torch.empty(saved["ids_executed"].shape, dtype=torch.float32,
                              device=moe.device)
    backward_input_grads(moe, saved, w13, grad_x, grad_scores)
    return grad_x, grad_scores
