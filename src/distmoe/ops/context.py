"""MoEContext: the collective object that owns a layer's peer buffers and runs it.

Per rank, on the symmetric heap (docs/design.md, buffers per rank):

    routing   128-byte header (int32 token count) + int16 expert ids [T_max, K]
    dispatch  [T_max * K, D] bf16: x at rows 0..T-1 in forward
    combine   [T_max * K, D] bf16: expert results at route slot t*K + k

(In backward the owners push route output gradients straight into the experts' scratch rather
than through the combine buffer, which saves a write and a read of T*K*D bf16 per layer:
:mod:`distmoe.ops.autograd`.)

plus, at EP > 1, a pull buffer [EP * T_max, D] bf16 with int8 flags [EP * T_max] and a
pointer table [R_cap] int64 (:mod:`distmoe.kernels.movement.pull_tokens`: each peer token W13 reads
crosses NVLink once instead of once per route and column tile), plus local memory in
activation rows (compact: executed row j of local expert e is row ``row_offsets[e] + j``,
see :mod:`distmoe.routing.tables`), ``R_b`` = the receive bound:

    inference  h2 [R_b, F] bf16 scratch
    training   the activation buffer sized by ``plan_memory`` (:mod:`distmoe.ops.activations`):
               slots that keep saved state until backward, and one shared scratch region;
               allocated on the heap too, because peers write into it: the experts return
               a saved layer's h3 rows straight into its owner's slot (step 5), and in
               backward the owners push route output gradients into the experts' scratch

Forward of one call (no host synchronisation; every step is a device op on the current stream,
or on a side stream forked from it and joined back, so the whole call can be captured in a
CUDA graph and replayed with new inputs written into the same tensors):

    1. publish: header <- T, ids -> routing buffer (int16), x -> dispatch rows 0..T-1 (at
       EP = 1 W13 reads x in place instead, through a rewritten table, see step 4; no
       copy either when x is :meth:`MoEContext.input_buffer`, written there by the caller)
    2. barrier                                 (everyone's ids and x are visible)
    3. gather every rank's ids [EP, T, K]; build expert-major tables (distmoe.routing)
    4. W13 grouped GEMM, gather prologue reads source rows from the owners' dispatch buffers
       (at EP = 1 from x: the table is rewritten, :mod:`distmoe.kernels.movement.pull_tokens`, and
       the tables keep the dispatch rows for a backward's replay, which copies the saved x back
       there. At EP > 1 peers' tokens are first pulled once into local memory; where nearly
       all of them are needed, :func:`distmoe.plan.rules.pull_all`, every peer token is copied
       on a side stream from step 3 on, joined here, and with long expert segments
       (:func:`distmoe.plan.rules.w13_phases`) W13 runs the row blocks of own tokens before
       the join and the rest after it, :mod:`distmoe.kernels.w13_forward.phases`), SwiGLU
       epilogue -> h2
    5. W2 grouped GEMM, scatter epilogue stores each row into its owner's combine slot
       (training, saved layer: into the h3 rows of the owner's activation slot instead).
       At EP > 1 in inference, where every rank has a GPU of its own, W13 and W2 can run as
       one persistent kernel (Mega, :mod:`distmoe.kernels.mega`) whose W2 tiles wait for
       device counters of stored h2 rows: steps 4-5 in one launch. Off unless the plan asks
       for it (``overrides={"layer": {"mega": True}}``); it becomes a pipeline of its own.
    6. barrier                                 (all results have landed; all gathers done)
    7. owner combine y[t] = sum_k score[t,k] * h3[t*K+k] over executed routes, fp32, with
       h3 the combine buffer (or the slot's h3 rows)

Barrier 6 also makes the next call's step 1 safe: no peer still reads this rank's dispatch.

Receive bound: a rank executes at most R_b = cfg.receive_bound(EP, total=True) rows (the
device bound, or with ``cfg.total_scratch_factor`` in bf16 inference the larger one, whose
rows beyond the device bound keep their h2 scratch in pinned host pages of the same virtual
range, :class:`~distmoe.runtime.vmm.TieredRange`). Routes beyond are
never written anywhere; they are counted on the device
(:meth:`MoEContext.stats`), their owners leave them out of the combine, and
``check=True`` turns them into a RuntimeError naming the rank, the rows and the bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..kernels.base.device import num_sms
from ..kernels.mega.gluon import fused_reason, fused_w13_w2
from ..kernels.movement.call_counters import count_call
from ..kernels.movement.combine import combine
from ..kernels.movement.offset_copy import offset_copy
from ..kernels.movement.publish_ids import publish_ids
from ..kernels.movement.pull_tokens import BLOCK_FLAG_ROWS, pull_tokens
from ..kernels.w2_forward.triton import w2_scatter
from ..kernels.w13_forward.phases import first_blocks, phase_waves, w13_phase_order
from ..kernels.w13_forward.triton import gather_w13_swiglu, w13_tile_rows
from ..plan import KernelPlan, plan_kernels
from ..quant.prepare import PreparedWeight
from ..routing import build_routing_tables, row_capacity
from ..runtime import create_heap
from ..runtime.heap import gather_objects, round_up, solo
from ..runtime.vmm import TieredRange
from .activations import ActivationBuffer
from .autograd import MoEFunction, backward_eager
from .custom_ops import context_id, traced_call, tracing
from .graphs import ForwardGraphs, FP8TrainGraphs, GraphPool, TrainingGraphs
from .lowp import LOWP_PRECISIONS, allocate_lowp, check_prepared, lowp_forward
from .lowp_train import FP8TrainFunction, fp8_train_configs, train_weights
from .transport import inner_config, nccl_call, node_groups, resolve_transport
from .validation import (
    check_call,
    check_main_grads,
    check_together,
    check_values,
    warn_inference_grad,
)

HEADER_BYTES = 128
#: rows of the W13 row blocks the two-launch schedule moves (distmoe.kernels.w13_forward.phases):
#: the blocks pull_tokens flags
_PHASE_ROWS = BLOCK_FLAG_ROWS


@dataclass(frozen=True)
class BackwardBuffers:
    """What :mod:`distmoe.ops.autograd` reads of a training context besides its plan (the
    declared interface between the two; set once at construction).

    Attributes:
        dispatch: this rank's dispatch rows, bf16 ``[T_max * K, D]`` (heap).
        combine: this rank's combine rows, bf16 ``[T_max * K, D]`` (heap).
        gh3_bases: int64 ``[EP]``: every rank's address of its scratch gh3 row 0.
        replay_offsets: int64 ``[2]``: element offsets of the replay's h1g and xs outputs in
            the activation buffer (-1: no x rows stored).
        table_origin: address of this rank's dispatch rows where the W13 WGRAD reads a kept
            input's rows in place (``ActivationBuffer.rows_in_place``), else 0.
        score_parts: fp32 score-gradient parts per route, one per W2 DGRAD column tile.
    """

    dispatch: torch.Tensor
    combine: torch.Tensor
    gh3_bases: torch.Tensor
    replay_offsets: torch.Tensor
    table_origin: int
    score_parts: int


class MoEContext:
    """Collective owner of one MoE layer's peer buffers on every rank of an EP group.

    Args:
        cfg: the layer (:class:`distmoe.MoEConfig`); ``cfg.num_experts`` must be divisible
            by the group size.
        group: the expert-parallel process group (default: the world group; this process
            alone where torch.distributed is not initialised). ``"local"``: this process
            alone in any case (a one-rank group of its own).
        device: this rank's device (default: the current CUDA device, else CPU).
        backend: heap backend (``"auto"``, ``"cpu"``, ``"cuda_ipc"``, ``"cuda_symm"``).
        overrides: entries of the kernel plan to replace (``ctx.plan``, see
            :mod:`distmoe.plan`): ``{"w13": {"num_stages": 3}, "layer": {"pull_all": True}}``;
            an override that cannot apply raises ``ValueError`` before any buffer exists.
        graphs: contexts on a CUDA device replay eager calls from CUDA graphs they capture
            themselves, one per call key (T, id and score dtypes, weight addresses, and in
            training the slot and layer, or at FP8 the weights' quantised forms and one
            graph per live call; :mod:`distmoe.ops.graphs`), the forward and in training
            the backward: the same bits at a fraction of the host time. ``False`` runs every
            call eagerly. Off with ``check=True``.
        transport: how rows cross between ranks. ``"peer"``: every rank maps every other's
            memory (one host: CPU shared memory, CUDA IPC or symmetric memory), the kernels
            read and write peers' buffers. ``"nccl"``: torch.distributed collectives
            (all-gather, reduce-scatter) around a one-rank context of this process
            (:mod:`distmoe.ops.transport`; for ranks on several nodes). ``"auto"``
            (default): ``"peer"`` when every rank of the group runs on this host, else
            ``"nccl"`` (a collective over the group's host names). ``ctx.transport``,
            ``ctx.explain()`` and ``ctx.stats()`` say which. ``"hierarchical"``: peer memory
            inside a node, collectives between nodes of ``node_size`` consecutive ranks;
            ``"auto"`` picks it where the ranks form equal nodes on one host each.
        node_size: ranks per node for ``"hierarchical"`` (default: from the ranks' host
            names; tests split one host into "nodes" with it).
        timeout: seconds a host barrier waits for every rank (CPU ranks: the shared-memory
            heap's barriers) before every rank that is still there raises a RuntimeError
            naming the ranks that did not arrive and the step; the context is unusable after
            (``None``: the process group's own timeout). On the GPU heaps each device
            barrier gives up after that many seconds and records which rank did not arrive
            (:mod:`distmoe.runtime.barrier`); the host sees it without synchronising, and
            this rank's next layer call raises a RuntimeError naming that rank (the call
            whose barrier timed out returns invalid results; ``None``: the device barriers
            wait without limit).
        main_grad: training only. The backward adds the weight gradients, accumulated in fp32,
            into each weight's ``main_grad`` attribute (an fp32 tensor of the weight's shape
            on ``device``, contiguous: Megatron's convention; the caller zeroes it) and gives
            the weights no ``.grad``; the default returns bf16 gradients that autograd puts
            in ``.grad``. Micro-batches then accumulate without a bf16 rounding each, and the
            whole backward, weight gradients included, replays from the context's graphs
            (the buffers stay where they are).
        check: debugging mode (it synchronises; off by default). Before each call, every
            rank checks its inputs, including ids outside [-1, E), a token naming an expert
            twice and non-zero scores on inactive routes, and the ranks share the outcome,
            their token counts, which context they called and whether they take the
            autograd path over the group: if any rank's input is refused, or these differ
            between ranks, every rank raises (the refusing rank its own
            ``TypeError``/``ValueError``, the others a ``ValueError`` naming it) before any
            buffer is touched. Unchecked, a rank with bad input raises alone and its peers
            wait for it at the next barrier. After each call, every rank raises (a
            ``RuntimeError``) when any rank received more rows than its receive bound; a
            training call's layer then leaves its slot.

    Call: ``y = ctx(x, expert_ids, scores, w13, w2)`` with x [T, D] bf16 (T <= max_tokens, the
    same T on every rank: ``check=True`` refuses a call where it differs, unchecked it is
    counted in ``stats()["token_count_mismatches"]``; T = 0 only without autograd),
    expert_ids [T, K] int8 / uint8 / int16 / int32 / int64 (global ids, -1 inactive; unchecked,
    an id outside [-1, E) is dropped and counted in ``stats()["invalid_ids"]``), scores [T, K]
    float32 / bfloat16 / float16 / float64, w13 [E_local, 2, F, D] bf16 with the gate
    projection ``w13[e, 0]`` and the up projection ``w13[e, 1]`` (y_e = (silu(x gate^T) *
    (x up^T)) w2[e]^T), w2 [E_local, D, F] bf16, all contiguous on ``device`` (a CPU or CUDA
    device).
    Returns y [T, D] bf16.

    Training: with ``cfg.training``, grad mode on and any of x / scores / w13 / w2 requiring
    grad, the call goes through :class:`distmoe.ops.autograd.MoEFunction` (y has a grad_fn).
    Its backward is collective: every rank must take that path for the same calls and run
    their backwards in the same order (see :mod:`distmoe.ops.autograd`).

    A training context owns one activation buffer (``ctx.activations``, exactly
    ``plan_memory(cfg, EP).activation_buffer_bytes`` bytes): one context serves a stack of
    layers of the same shape (pass each layer's weights). Each autograd call appends its state
    to the selected slot (``select_slot``), saving it whole or keeping only its input for a
    replay in backward, decided on the device with the worst rank's rows. A slot holds at most
    ``cfg.max_layers_per_slot`` layers, whose backwards run in reverse order.
    """

    _constructed: dict = {}  # contexts constructed per group in this process (check mode)

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup | None = None, *,
                 device: torch.device | str | None = None, backend: str = "auto",
                 check: bool = False, overrides: Mapping[str, Any] | None = None,
                 graphs: bool = True, main_grad: bool = False,
                 transport: str = "auto", node_size: int | None = None,
                 timeout: float | None = 600.0) -> None:
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a distmoe.MoEConfig, got {type(cfg).__name__}")
        if cfg.precision not in ("bf16", *LOWP_PRECISIONS):
            raise ValueError(f"precision ({cfg.precision!r}) must be 'bf16', 'mxfp8' or "
                             "'fp8_block' (training and inference) or 'nvfp4' or 'mxfp4' "
                             "(inference)")
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool, got {type(check).__name__} ({check!r})")
        if not isinstance(graphs, bool):
            raise TypeError(f"graphs must be a bool, got {type(graphs).__name__} ({graphs!r})")
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"timeout ({timeout!r}) must be None or a finite number of "
                             "seconds > 0")
        if not isinstance(main_grad, bool):
            raise TypeError(f"main_grad must be a bool, got {type(main_grad).__name__} "
                            f"({main_grad!r})")
        if main_grad and not cfg.training:
            raise ValueError("main_grad=True needs a training context (cfg.training=True): "
                             "it says where the weight gradients go")
        if device is not None:
            try:
                kind = torch.device(device).type
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device ({device!r}) is not a torch device: {exc}") from None
            if kind not in ("cpu", "cuda"):
                raise ValueError(f"device ({device!r}) must be a CPU or CUDA device, got "
                                 f"device type {kind!r}")
            if kind == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device ({device!r}) is a CUDA device, but CUDA is not "
                                 "available in this process")
        #: "peer" (every rank maps every other's memory), "nccl" or "hierarchical"
        #: (:mod:`distmoe.ops.transport`)
        self.transport, node_size = resolve_transport(transport, group, node_size)
        _check_host_tier(cfg, transport, self.transport)
        #: this context's number in traced graphs (:mod:`distmoe.ops.custom_ops`)
        self.op_number = context_id(self)
        if self.transport in ("nccl", "hierarchical"):
            self._init_collective(cfg, group, node_size, device=device, backend=backend,
                                  check=check, overrides=overrides, graphs=graphs,
                                  main_grad=main_grad, timeout=timeout)
            return
        # the plan first: an override that cannot apply is refused before any buffer exists
        ep_size = 1 if solo(group) else dist.get_world_size(group)
        plan_device = device
        if plan_device is None and torch.cuda.is_available():
            plan_device = torch.device("cuda", torch.cuda.current_device())
        #: every kernel and launch config this context's calls use (:mod:`distmoe.plan`)
        self.plan: KernelPlan = plan_kernels(cfg, ep_size=ep_size, device=plan_device,
                                             overrides=overrides)
        if cfg.training:
            dgrad_cols = self.plan.w2_dgrad.block_n
            score_parts = -(-cfg.ffn // dgrad_cols)
            if 1 + score_parts > cfg.hidden // 2:
                raise ValueError(
                    f"training needs hidden/2 >= 1 + ceil(ffn / {dgrad_cols}): the route's "
                    "score and its gradient parts travel as fp32 values in its bf16 combine "
                    f"row, got hidden = {cfg.hidden} (room for {cfg.hidden // 2}) and ffn = "
                    f"{cfg.ffn} ({1 + score_parts} needed)")
        self.cfg = cfg
        self.check = check
        #: weight gradients added in fp32 into ``w13.main_grad`` / ``w2.main_grad``
        self.main_grad = main_grad
        self._bound_seen = (0, 0)  # check mode: invalid ids and dropped rows already reported
        self._closed = False
        self.heap = create_heap(group, backend=backend, device=device)
        self.heap.timeout = timeout
        self.group = self.heap.group
        self._serial = self._number_on_group()
        self.rank, self.ep_size = self.heap.rank, self.heap.world_size
        self.device = self.heap.device
        self.num_local_experts = cfg.experts_per_rank(self.ep_size)
        T, K, D, F = cfg.max_tokens, cfg.top_k, cfg.hidden, cfg.ffn
        #: rows a rank executes at most: with ``cfg.total_scratch_factor`` (bf16 inference)
        #: those beyond :attr:`device_rows` keep their scratch in pinned host pages
        self.receive_bound = cfg.receive_bound(self.ep_size, total=True)
        #: rows whose scratch is device memory
        self.device_rows = cfg.receive_bound(self.ep_size)
        self.row_capacity = row_capacity(self.receive_bound, self.num_local_experts,
                                         cfg.row_block)
        self.row_bytes = D * 2
        assert self.plan.ep_size == self.ep_size, "the plan's EP size is the heap's"
        heap = self.heap
        heap.allocate("routing", HEADER_BYTES + round_up(T * K * 2, 128))
        heap.allocate("dispatch", T * K * D * 2)
        heap.allocate("combine", T * K * D * 2)
        self._headers = [heap.view("routing", r, torch.int32, (HEADER_BYTES // 4,))
                         for r in range(self.ep_size)]
        self._ids = [heap.view("routing", r, torch.int16, (T, K), HEADER_BYTES)
                     for r in range(self.ep_size)]
        self._dispatch = heap.view("dispatch", self.rank, torch.bfloat16, (T * K, D))
        self._combine = heap.view("combine", self.rank, torch.bfloat16, (T * K, D))
        self.activations: ActivationBuffer | None = None
        #: the inference scratch's tiers where some of it is host-backed (VMM), else None
        self.scratch_range: TieredRange | None = None
        if cfg.training:
            # On the heap: the owners write their routes' output gradients straight into the
            # experts' scratch gh3 rows in backward (distmoe.ops.autograd, step 1).
            self.activations = ActivationBuffer(
                cfg, self.ep_size, self.rank, self.device,
                allocate=lambda nbytes: heap.allocate("activations", nbytes))
            self._h2 = self.activations.scratch["h2"]
            acts = self.activations
            so = acts.scratch_elem_offsets
            # At EP = 1 a layer that keeps x instead of its rows may have its W13 WGRAD read
            # x's rows in place (acts.rows_in_place), through the forward's gather table (row
            # t of the dispatch buffer, moved to row t of the kept x): no regathered copy,
            # and a replay stores h1 only. Where the table's rows are (read once, here):
            self._table_origin = (int(heap.base_table("dispatch")[self.rank])
                                  if acts.rows_in_place else 0)
            # every rank's scratch gh3 row 0 (same layout on every rank); [h1g, xs] element
            # offsets (the replay's W13 outputs; -1: no x rows stored)
            self.backward_buffers = BackwardBuffers(
                dispatch=self._dispatch, combine=self._combine,
                gh3_bases=heap.base_table("activations") + acts.scratch_layout["gh3"][0],
                replay_offsets=torch.tensor([so["h1g"], so.get("xs", -1)], dtype=torch.int64,
                                            device=self.device),
                table_origin=self._table_origin,
                score_parts=-(-F // self.plan.w2_dgrad.block_n))
        elif self.receive_bound > self.device_rows:
            # h2 [R, F], the only scratch sized by the rows: row r at byte 2 F r of one
            # virtual range, device pages for the rows below the device bound, pinned host
            # pages for the rest (the kernels index rows as ever; a call with few rows stays
            # in device memory)
            try:
                self.scratch_range = TieredRange(
                    [(self.device_rows * F * 2, "device"),
                     ((self.receive_bound - self.device_rows) * F * 2, "host")], self.device)
            except BaseException:
                heap.close()  # every rank fails alike (the same driver)
                self._closed = True
                raise
            self._h2 = self.scratch_range.tensor[:self.receive_bound * F * 2].view(
                torch.bfloat16).view(self.receive_bound, F)
        else:
            self._h2 = torch.empty(self.receive_bound, F, dtype=torch.bfloat16,
                                   device=self.device)
        if self.ep_size > 1:
            self._pulled = torch.empty(self.ep_size * T, D, dtype=torch.bfloat16,
                                       device=self.device)
            self._pull_flags = torch.zeros(self.ep_size * T, dtype=torch.int8,
                                           device=self.device)
        # the table W13 reads (peer tokens pulled, own tokens read in place at EP = 1)
        self._pulled_ptrs = torch.empty(self.row_capacity, dtype=torch.int64,
                                        device=self.device)
        if self.ep_size > 1 and self.row_capacity % 128 == 0:
            # per 128 padded rows: Mega's count of stored h2 tiles, then its next schedule
            # position; zeroed before each call that uses them
            self._h2_done = torch.zeros(self.row_capacity // 128 + 1, dtype=torch.int32,
                                        device=self.device)
        if cfg.pipeline == "mega":  # asked for by name: refused now, where it cannot run
            reason = self._mega_reason(False)
            if reason is not None:
                heap.close()  # every rank has the same reason: each closes and raises
                self._closed = True
                raise ValueError(f"pipeline 'mega' (W13 and W2 in one kernel) cannot run "
                                 f"here: {reason}; use 'staged' or 'auto'")
        if self.ep_size > 1:
            self._peer_tokens = [heap.view("dispatch", r, torch.bfloat16, (T, D))
                                 for r in range(self.ep_size)]
            if self.row_capacity % _PHASE_ROWS == 0:
                blocks = self.row_capacity // _PHASE_ROWS
                self._block_peer = torch.zeros(blocks, dtype=torch.int8, device=self.device)
                self._w13_order = torch.zeros(blocks, dtype=torch.int32, device=self.device)
                self._w13_positions = torch.zeros(4, dtype=torch.int32, device=self.device)
                self._w13_starts = torch.zeros(blocks + 1, dtype=torch.int8, device=self.device)
        self._pull_stream = None
        # Device-side counters: [last received rows, max received rows, dropped rows total,
        # invalid ids total, calls, calls with a token count that differs between ranks]
        # (distmoe.kernels.movement.call_counters).
        self._counters = torch.zeros(6, dtype=torch.int64, device=self.device)
        #: MXFP8 / block-FP8 / NVFP4 scratch (:mod:`distmoe.ops.lowp`); None at bf16
        self._lowp = allocate_lowp(cfg, self.num_local_experts, self.receive_bound, self.device,
                                   self.ep_size, self.plan.fp4_fp8_operands(cfg))
        #: the extra GEMM configs of an FP8 training context (:mod:`distmoe.ops.lowp_train`)
        self._lowp_train = (fp8_train_configs(cfg, self.device)
                            if cfg.training and self._lowp is not None else None)
        #: the captured calls (:mod:`distmoe.ops.graphs`; None: every call eager):
        #: ForwardGraphs in inference contexts (every precision), TrainingGraphs in bf16
        #: training contexts, FP8TrainGraphs in FP8 training contexts
        self.graphs: ForwardGraphs | TrainingGraphs | FP8TrainGraphs | None = None
        if graphs and not check and self.device.type == "cuda":
            pool = GraphPool(self.device)
            kind = (ForwardGraphs if not cfg.training else
                    TrainingGraphs if self._lowp is None else FP8TrainGraphs)
            self.graphs = kind(self, pool)

    def _init_collective(self, cfg, group, node_size, **kwargs) -> None:
        """``transport`` "nccl" or "hierarchical" (:mod:`distmoe.ops.transport`): the group's
        size and this rank from torch.distributed; the experts run by ``self.inner``, a
        one-rank context of this process ("nccl") or a peer-memory context over this rank's
        node ("hierarchical"), whose plan, activation buffer, graphs and heap this context
        shows. Collective (new process groups for "hierarchical")."""
        self.cfg, self.check, self.main_grad = cfg, kwargs["check"], kwargs["main_grad"]
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.ep_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.num_local_experts = cfg.experts_per_rank(self.ep_size)
        self.receive_bound = self.device_rows = cfg.receive_bound(self.ep_size)
        self.scratch_range = None
        self._bound_seen = (0, 0)
        self._closed = False
        self._serial = self._number_on_group()
        if self.transport == "nccl":
            node_size, node_group, self.cross_group = 1, "local", self.group
        else:
            node_group, self.cross_group = node_groups(self.group, node_size)
        self.node_size = node_size
        inner_cfg = inner_config(cfg, self.ep_size, node_size)
        #: first global expert of the experts ``inner`` runs (this rank's node's, or its own)
        self.expert_base = (self.rank // node_size) * inner_cfg.num_experts
        #: the context that runs this node's experts (one rank for "nccl")
        self.inner = MoEContext(inner_cfg, node_group, **kwargs)
        self.device = self.inner.device
        self.plan, self.activations = self.inner.plan, self.inner.activations
        self.graphs, self.heap = self.inner.graphs, self.inner.heap
        # the low-precision scratch and configs the checks read (the inner context runs them)
        self._lowp, self._lowp_train = self.inner._lowp, self.inner._lowp_train
        self._dispatch = torch.empty(0, dtype=torch.bfloat16, device=self.device)
        self._invalid_ids = torch.zeros((), dtype=torch.int64, device=self.device)

    def _number_on_group(self) -> int:
        """This context's construction number on ``self.group`` in this process (check mode:
        which context a call is on). Construction is collective, so the ranks of a group
        number the contexts on it alike; calls on two contexts interleaved in a different
        order on two ranks would pair their barriers across contexts."""
        key = id(self.group)
        MoEContext._constructed[key] = MoEContext._constructed.get(key, 0) + 1
        return MoEContext._constructed[key]

    # ------------------------------------------------------------------ validation
    def _validate(self, x, expert_ids, scores, w13, w2) -> None:
        weights = (w13, w2)
        if self.cfg.precision in LOWP_PRECISIONS and not self.cfg.training:
            # prepared weights: checked here (a training context takes the parameters)
            check_prepared(self._lowp, self.device, w13, w2, self.cfg.precision)
            weights = (None, None)
        elif self.cfg.precision in LOWP_PRECISIONS:
            for name, w in (("w13", w13), ("w2", w2)):
                if isinstance(w, PreparedWeight):
                    raise TypeError(
                        f"{name} must be the layer's weight tensor in a {self.cfg.precision} "
                        "training context (it quantises the weights itself, once per weight "
                        "version), got a PreparedWeight: prepared weights are for "
                        "MoEConfig(training=False)")
        check_call(self.cfg, self.num_local_experts, self.device, self._dispatch, x,
                   expert_ids, scores, *weights,
                   wants_autograd=lambda: self._wants_autograd(x, scores, w13, w2))
        if self.main_grad and self._wants_autograd(x, scores, w13, w2):
            check_main_grads(w13, w2)

    def _validate_together(self, x, expert_ids, scores, w13, w2) -> None:
        """``check`` mode: every rank's checks, shared over the group
        (:func:`distmoe.ops.validation.check_together`)."""
        def run_checks():
            self._validate(x, expert_ids, scores, w13, w2)
            check_values(self.cfg.num_experts, expert_ids, scores)

        check_together(self.group, self.ep_size, self._serial, x, run_checks,
                       lambda: self._wants_autograd(x, scores, w13, w2))

    # ------------------------------------------------------------------ forward
    def input_buffer(self, tokens: int | None = None) -> torch.Tensor:
        """This rank's dispatch rows as a bf16 ``[tokens, hidden]`` tensor on ``device``
        (``tokens`` defaults to ``cfg.max_tokens``), for a forward's input written in place.

        Write x here (for instance as the ``out=`` of the op that computes it) and pass this
        tensor as ``x``: the forward then skips step 1's copy of x into the buffer, ``T *
        hidden * 2`` bytes read and written. At EP > 1 that copy precedes the barrier the
        peers' token copy waits for, so it is on the forward's critical path.

        Inference contexts only (``cfg.training=False``): a training forward's input must
        outlive the call, and a replayed layer's backward writes these rows. The rows belong
        to the context: the next forward (of any layer on this context) may be called once
        they hold its input, and they must not be written while a forward that reads them
        runs. Writes in stream order after the previous forward was issued are safe: every
        peer has read them before that forward's end barrier (module docstring, step 6).
        A view that overlaps the buffer without starting at its first row is refused as x.
        """
        self.check_open()
        if self.transport != "peer":
            raise ValueError(f"input_buffer is for the peer transport (transport="
                             f"{self.transport!r} gathers x itself)")
        if self.cfg.training:
            raise ValueError("input_buffer is for inference contexts (cfg.training=False): "
                             "a training forward's input must outlive the call")
        T = self.cfg.max_tokens if tokens is None else tokens
        if isinstance(T, bool) or not isinstance(T, int):
            raise TypeError(f"tokens must be an int, got {type(T).__name__}")
        if not 1 <= T <= self.cfg.max_tokens:
            raise ValueError(f"tokens must be in [1, max_tokens = {self.cfg.max_tokens}], "
                             f"got {T}")
        return self._dispatch[:T]

    def _x_in_input_buffer(self, x) -> bool:
        """Whether x starts at the first row of :meth:`input_buffer` (no copy in step 1)."""
        return x.data_ptr() == self._dispatch.data_ptr()

    def __call__(self, x, expert_ids, scores, w13, w2) -> torch.Tensor:
        precision = self.cfg.precision
        lowp = precision in LOWP_PRECISIONS  # .lowp (inference), .lowp_train (training)
        collective = self.transport != "peer"  # "nccl" / "hierarchical": .transport
        if tracing(x):  # torch.compile / make_fx / fake tensors
            if lowp:
                raise NotImplementedError(
                    f"precision {precision!r} does not run under torch.compile / make_fx / "
                    "fake tensors yet: call the context eagerly")
            if not collective:
                return traced_call(self, x, expert_ids, scores, w13, w2)  # .custom_ops
        self.check_open()
        if self.check:
            self._validate_together(x, expert_ids, scores, w13, w2)
        else:
            self._validate(x, expert_ids, scores, w13, w2)
        if collective:
            y = nccl_call(self, x, expert_ids, scores, w13, w2,
                          autograd=self._wants_autograd(x, scores, w13, w2))
        elif self._wants_autograd(x, scores, w13, w2):
            function = FP8TrainFunction if lowp else MoEFunction
            y = function.apply(self, x, expert_ids, scores, w13, w2)
        elif lowp:
            if self.cfg.training:  # a call without autograd: the parameters' forward forms
                tw = train_weights(self, w13, w2)
                w13, w2 = (tw.w13_q, tw.w13_s), (tw.w2_q, tw.w2_s)
            else:
                warn_inference_grad(x, scores, f"this is a {precision} inference context: y "
                                    "has no grad_fn and no gradient flows back through this "
                                    f"layer (use MoEConfig(precision={precision!r}, "
                                    "training=True) for gradients).")
            y = None
            if isinstance(self.graphs, ForwardGraphs):  # inference contexts only
                y = self.graphs(x, expert_ids, scores, w13, w2)
            if y is None:
                with torch.no_grad():
                    y = lowp_forward(self, x, expert_ids, scores, w13, w2)
        else:
            if not self.cfg.training:
                warn_inference_grad(x, scores, "this is an inference context (cfg.training is "
                                    "False): y has no grad_fn and no gradient flows back "
                                    "through this layer. Use MoEConfig(training=True) for "
                                    "gradients, or torch.no_grad() for inference.")
            y = None
            if isinstance(self.graphs, ForwardGraphs):
                y = self.graphs(x, expert_ids, scores, w13, w2)
            if y is None:
                y, _ = self.forward_layer(x, expert_ids, scores, w13, w2)
        if self.check:
            self._check_bound(y)
        return y

    def _publish_and_route(self, x, expert_ids, pull_all: bool = False, *, pack=None,
                           copy_elems: int | None = None):
        """Steps 1-3. ``pack(x, slots)``: writes each token's row into its dispatch slot
        (``slots``: the dispatch rows as uint8 ``[T_max, 2 D]``) in another format instead
        of the bf16 copy; peers then copy the first ``copy_elems`` bf16 elements of a slot
        (default all)."""
        T = x.shape[0]
        # T and the ids in one launch; an id outside [-1, E) becomes an invalid -2 (a plain
        # int16 copy would wrap ids beyond int16 into valid ones)
        publish_ids(expert_ids, self._ids[self.rank], self._headers[self.rank],
                    num_experts=self.cfg.num_experts)
        if pack is not None:
            pack(x, self._dispatch.view(torch.uint8))
        elif not self._reads_x(x) and not self._x_in_input_buffer(x):
            self._dispatch[:T].copy_(x)
        self.heap.barrier()
        if pull_all:
            self._start_pull_all(copy_elems)
        ids_EPTK = torch.stack([ids[:T] for ids in self._ids])
        tables = build_routing_tables(
            ids_EPTK, rank=self.rank, num_local_experts=self.num_local_experts,
            row_block=self.cfg.row_block, receive_bound=self.receive_bound,
            dispatch_bases_EP=self.heap.base_table("dispatch"),
            combine_bases_EP=self.heap.base_table("combine"),
            row_bytes=self.row_bytes, training=self.cfg.training,
        )
        self._count_call(tables, T)
        return tables

    def _count_call(self, tables, tokens: int) -> None:
        """The device counters of :meth:`stats`, from this call's tables and every rank's
        published token count (one launch, after the publish barrier)."""
        count_call(self._counters, tables.num_recv_rows, tables.num_dropped_rows,
                   tables.num_invalid_ids, header_bases=self.heap.base_table("routing"),
                   headers=self._headers, tokens=tokens)

    def _start_pull_all(self, copy_elems: int | None = None) -> None:
        """Copy every peer's ``max_tokens`` token rows into the pull buffer (after the
        publish barrier), one copy per peer: on CUDA on a side stream, by the copy engines,
        so that it overlaps the routing tables; :meth:`gather_table` with ``pulled`` joins
        it. ``copy_elems``: the first elements of each row only (packed rows)."""
        T = self.cfg.max_tokens
        cols = slice(None) if copy_elems is None else slice(0, copy_elems)

        def copy():
            for r in range(self.ep_size):
                if r != self.rank:
                    self._pulled[r * T:(r + 1) * T, cols].copy_(self._peer_tokens[r][:, cols])

        if self.device.type != "cuda":
            copy()
            return
        if self._pull_stream is None:
            self._pull_stream = torch.cuda.Stream(self.device)
        self._pull_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._pull_stream):
            copy()

    def _reads_x(self, x) -> bool:
        """Whether this forward's W13 reads x in place (EP = 1, 16-byte aligned rows for its
        vector loads) instead of a copy in the dispatch buffer."""
        return self.ep_size == 1 and x.data_ptr() % 16 == 0

    def gather_table(self, gather_ptrs, enable=None, *, pulled: bool = False, x=None,
                      phased: bool = False, copy_elems: int | None = None):
        """The table W13 reads its A rows through. At EP = 1: with ``x`` (a forward's input,
        where :meth:`_reads_x`) a copy of ``gather_ptrs`` that names x's rows, else
        ``gather_ptrs`` itself. At EP > 1 a copy whose peer tokens point at local copies,
        pulled once per token (see :mod:`distmoe.kernels.movement.pull_tokens`; ``enable`` an
        optional device predicate). With ``pulled`` (after :meth:`_start_pull_all`) the tokens are
        being copied already: the table is rewritten and the copy joined, or with ``phased``
        not joined yet but the row blocks that name peer tokens flagged
        (:meth:`_run_w13` joins it between its two launches). ``copy_elems``: the first
        elements of each pulled row only (packed rows)."""
        if self.ep_size == 1:
            if x is None or not self._reads_x(x):
                return gather_ptrs
            return pull_tokens(gather_ptrs, self.heap.base_table("dispatch"), 0, None, None,
                               self._pulled_ptrs, own_src=x, t_max=self.cfg.max_tokens)

        out = pull_tokens(gather_ptrs, self.heap.base_table("dispatch"), self.rank,
                          self._pulled, self._pull_flags, self._pulled_ptrs, enable=enable,
                          pulled=pulled, block_flags=self._block_peer if phased else None,
                          copy_elems=copy_elems)
        if pulled and not phased:
            self._join_pull()
        return out

    def _join_pull(self) -> None:
        """The current stream waits for :meth:`_start_pull_all`'s copy (on CUDA)."""
        if self._pull_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._pull_stream)

    def _phased_w13(self) -> bool:
        """Whether a forward with every peer token copied runs W13 in two launches
        (:meth:`_run_w13`): by the plan (:meth:`KernelPlan.phased_w13`) where the W13 tiles
        are the 128-row blocks the pull flags (ValueError where an override asks for it and
        the tiles do not allow it)."""
        if self.ep_size == 1:
            return False
        cfg = self.plan.w13
        fits = (hasattr(self, "_block_peer") and cfg.block_m == _PHASE_ROWS
                and w13_tile_rows(cfg) == _PHASE_ROWS)
        if self.plan.layer.w13_phases and not fits:
            raise ValueError(f"overrides['layer']['w13_phases']: the two-launch W13 needs "
                             f"{_PHASE_ROWS}-row tiles and a row capacity divisible by "
                             f"{_PHASE_ROWS}, got tiles of {w13_tile_rows(cfg)} rows and "
                             f"{self.row_capacity} rows")
        return fits and self.plan.phased_w13(self.cfg)

    def _w13_first_blocks(self) -> int:
        """Own row blocks of the first W13 launch (:func:`~distmoe.kernels.w13_forward.phases.\
first_blocks`), for the plan's W13 config and phase waves (host arithmetic)."""
        cfg, D, F = self.plan.w13, self.cfg.hidden, self.cfg.ffn
        num_pid_n = -(-F // cfg.block_n)
        programs = min(num_sms(self.device), self._block_peer.numel() * num_pid_n)
        waves = self.plan.layer.w13_phase_waves
        if waves is None:
            waves = phase_waves(
                copy_bytes=(self.ep_size - 1) * self.cfg.max_tokens * D * 2,
                tile_flops=2 * _PHASE_ROWS * 2 * cfg.block_n * D)
        return first_blocks(waves=waves, programs=programs, num_pid_n=num_pid_n)

    def _run_w13(self, phased: bool, gather_ptrs, po, ro, w13, **outputs) -> None:
        """W13 into ``self._h2`` (and ``outputs``: h1 / x / their offsets). With ``phased``,
        in two launches around the join of the peer-token copy: the row blocks of own tokens
        first (at most :meth:`_w13_first_blocks`), then the rest, the same bits
        (:mod:`distmoe.kernels.w13_forward.phases`)."""
        if not phased:
            gather_w13_swiglu(gather_ptrs, po, ro, w13, self._h2, config=self.plan.w13,
                              **outputs)
            return
        order, positions = self._w13_order, self._w13_positions
        w13_phase_order(self._block_peer, po, order, positions, self._w13_starts,
                        first=self._w13_first_blocks(), block_m=_PHASE_ROWS)
        gather_w13_swiglu(gather_ptrs, po, ro, w13, self._h2, config=self.plan.w13,
                          order=order, positions=positions[0:2], **outputs)
        self._join_pull()
        gather_w13_swiglu(gather_ptrs, po, ro, w13, self._h2, config=self.plan.w13,
                          order=order, positions=positions[2:4], **outputs)

    def _runs_mega(self, save: bool) -> bool:
        """Whether this forward runs W13 and W2 as one persistent kernel (Mega): where the
        plan says so (``overrides={"layer": {"mega": True}}``), ValueError where it cannot
        run (:meth:`_mega_reason`)."""
        if self.plan.mega_config is None:
            return False
        reason = self._mega_reason(save)
        if reason is not None:
            raise ValueError(f"Mega (W13 and W2 in one kernel) cannot run here: {reason}")
        return True

    def _mega_reason(self, save: bool) -> str | None:
        """``None`` when Mega can run in this forward, else why not: EP > 1 (the counters),
        inference, every rank on a GPU of its own (the ``cuda_symm`` heap: a W2 tile waiting
        on one rank could hold the SMs another rank's W13 needs where ranks share a GPU),
        and the kernel's own tiles (:func:`~distmoe.kernels.mega.gluon.fused_reason`)."""
        if self.ep_size == 1 or not hasattr(self, "_h2_done"):
            return "it needs EP > 1 (nothing crosses NVLink at EP = 1)"
        if save:
            return "the training forward saves its layers (inference only so far)"
        if self.heap.backend != "cuda_symm":
            return (f"the {self.heap.backend!r} heap (ranks may share a GPU); it needs "
                    "every rank on a GPU of its own")
        c = self.cfg
        return fused_reason(self.device, hidden=c.hidden, ffn=c.ffn,
                            config=self.plan.mega_config)

    def _run_w13_w2(self, phased: bool, gather_ptrs, po, ro, w13, w2, scatter_ptrs,
                    mega: bool = False) -> None:
        """W13 then W2 (steps 4-5) on the current stream, or with ``mega`` both in one
        kernel (not ``phased``: the copy is joined)."""
        if mega:
            counters = self._h2_done
            counters.zero_()
            fused_w13_w2(gather_ptrs, po, ro, w13, w2, self._h2, scatter_ptrs, counters,
                         config=self.plan.mega_config)
            return
        self._run_w13(phased, gather_ptrs, po, ro, w13)
        w2_scatter(self._h2, po, ro, w2, scatter_ptrs, config=self.plan.w2)

    def _wants_autograd(self, x, scores, w13, w2) -> bool:
        """Training call with autograd: cfg.training, grad mode on and an input requiring
        grad. The backward is collective (distmoe.ops.autograd): every rank must take the
        same path and run the backward of the same calls in the same order."""
        return (self.cfg.training and torch.is_grad_enabled()
                and any(t.requires_grad for t in (x, scores, w13, w2)))

    def forward_layer(self, x, expert_ids, scores, w13, w2, *, save: bool = False,
                      out: torch.Tensor | None = None):
        """Steps 1-7 of the module docstring on checked inputs; returns ``(y, saved)`` (used
        by :mod:`distmoe.ops.autograd` and :mod:`distmoe.ops.graphs`). ``out``: where y
        [T, D] bf16 goes (default: a new tensor).

        With ``save`` (training under autograd), the layer's state goes to the selected slot
        of the activation buffer (:meth:`ActivationBuffer.begin_layer` decides save or replay
        on the device): W13 writes h1 and the gathered rows there, W2 returns the route
        results there (every owner's slot, at once), or, for a replayed layer, x is copied
        there. ``saved`` is then a dict with the tables, the slot record, the executed ids
        (others -1) and fp32 scores; otherwise None."""
        acts = self.activations
        if save:
            acts.check_room()  # before anything is published
        T, K = expert_ids.shape
        pull_all = self.ep_size > 1 and self.plan.pulls_all(self.cfg, T)
        tables = self._publish_and_route(x, expert_ids, pull_all)
        po, ro = tables.padded_offsets, tables.row_offsets
        scores_f32 = scores.float().contiguous()
        y = torch.empty_like(x) if out is None else out
        mega = not save and self._runs_mega(save)
        phased = pull_all and not mega and self._phased_w13()
        gather_ptrs = self.gather_table(tables.gather_ptrs, pulled=pull_all, x=x,
                                         phased=phased)
        if not save:
            self._run_w13_w2(phased, gather_ptrs, po, ro, w13, w2, tables.scatter_ptrs,
                             mega)
            self.heap.barrier()
            # dest_rows_TK is -1 exactly where a route is not executed: it serves as the
            # combine's ids (only their sign is read)
            combine(self._combine[:T * K], tables.dest_rows_TK, scores_f32, y,
                    config=self.plan.combine)
            return y, None
        heap = self.heap
        rec = acts.begin_layer(tables.executed_rows_EP, self._combine.data_ptr(),
                               act_bases=heap.base_table("activations"),
                               combine_bases=heap.base_table("combine"),
                               rows_origin=self._table_origin)
        try:
            elements = acts.elements
            self._run_w13(phased, gather_ptrs, po, ro, w13, h1_out=elements, x_out=elements,
                          out_offsets=rec.offsets[0:2])
            offset_copy(elements, x, x.numel(), dst_offset=rec.offsets[3:4])
            # A saved layer's h3 rows go straight into each owner's slot (rec.h3_deltas); a
            # replayed layer's stay in the combine buffers.
            w2_scatter(self._h2, po, ro, w2, _shifted_returns(tables, rec.h3_deltas, T * K),
                       config=self.plan.w2)
            heap.barrier()
            ids_executed = torch.where(tables.is_route_executed_TK,
                                       expert_ids.to(torch.int32), -1)
            combine(None, ids_executed, scores_f32, y, rows_addr=rec.backward[0:1],
                    config=self.plan.combine)
        except BaseException:
            acts.abandon_layer(rec)  # keep the slot consistent on this rank
            raise
        return y, dict(tables=tables, record=rec, ids_executed=ids_executed,
                       scores_f32=scores_f32)

    def training_forward(self, x, expert_ids, scores, w13, w2):
        """``(y, saved)`` of a forward under autograd (:meth:`forward_layer` with ``save``),
        replayed from this context's CUDA graphs where they apply (:mod:`distmoe.ops.graphs`).
        Used by :class:`distmoe.ops.autograd.MoEFunction`."""
        if isinstance(self.graphs, TrainingGraphs):
            return self.graphs.forward(x, expert_ids, scores, w13, w2)
        return self.forward_layer(x, expert_ids, scores, w13, w2, save=True)

    def training_backward(self, saved: dict, grad_y, w13, w2, x_shape, weight_out):
        """The backward of one :meth:`training_forward` after its layer left the slot's stack:
        ``(grad_x bf16 [T, D], grad_scores fp32 [T, K])``, the weight gradients into
        ``weight_out`` (``(grad_w13, grad_w2)``, each ``None`` where not needed: new tensors,
        or the weights' ``main_grad`` with :attr:`main_grad`), from this context's CUDA graphs
        where they apply, else kernel by kernel (the same bits). Collective
        (:mod:`distmoe.ops.autograd`)."""
        if isinstance(self.graphs, TrainingGraphs):
            out = self.graphs.backward(saved, grad_y, w13, w2, x_shape, weight_out)
            if out is not None:
                return out
        return backward_eager(self, saved, grad_y, w13, w2, x_shape, weight_out)

    # ------------------------------------------------------------------ slots
    def select_slot(self, slot: int | torch.Tensor,
                    max_layers: int | torch.Tensor | None = None) -> None:
        """Select the activation slot that the next training forwards append to, and the
        layer-depth bound of its owner (how many layers it will put there; the save/replay
        rule reserves replay inputs for the later ones; default and maximum
        ``cfg.max_layers_per_slot``). Every rank must make the same selection before the
        same forward: each rank keeps a replica of every rank's slot cursors.

        Each is a host int (``slot`` in ``[0, cfg.num_slots)``, checked here) or a one-element
        integer tensor on this context's device, copied without synchronising: the forwards
        read the selection on the device, so a CUDA graph that captured them replays with
        whatever the tensors hold at replay time (a framework's schedule can write slot ids
        from :func:`distmoe.memory.assign_slots` into them). A device selection the forward
        finds invalid (slot out of range, bound out of range, slot already holding ``bound``
        layers) keeps nothing and is reported by the next forward (RuntimeError) and by
        ``stats()["activations"]["slot_errors"]``. A backward always uses the slot its forward
        recorded (a device snapshot), whatever is selected later. While a device-selected
        layer is live, this context's own CUDA graphs step aside (eager calls)."""
        self.check_open()
        self._require_training("select_slot")
        self.activations.select_slot(slot, max_layers)

    def reset_slots(self) -> None:
        """*Call on every rank at the same point.* Empty every slot: after an aborted schedule
        or after training forwards whose outputs were dropped without a backward (those keep
        their layer otherwise). Refused (RuntimeError) while a layer's autograd graph is alive
        (its backward can still run and owns its state: drop the outputs first). A later
        backward of a forgotten layer raises. Clears the device's slot selection errors."""
        self.check_open()
        self._require_training("reset_slots")
        self.activations.reset_slots()

    def _require_training(self, what: str) -> None:
        if self.activations is None:
            raise ValueError(f"{what} needs a training context (cfg.training=True)")

    # ------------------------------------------------------------------ bounds and stats
    def stats(self) -> dict:
        """Counters kept on this rank's device (reads device memory: synchronises; not for
        the hot path).

        Returns a dict: ``rank``, ``transport``, ``receive_bound`` (rows), ``row_capacity`` (padded rows),
        ``pull_buffer_bytes`` (the EP > 1 pull buffer, its flags and the W13 block order,
        and the pointer table W13 reads, at EP = 1 too),
        ``last_recv_rows``, ``max_recv_rows``, ``dropped_rows`` (routes this rank received
        and did not execute, summed over calls), ``invalid_ids`` (ids outside [-1, E) in
        the whole group's calls, summed: every rank reads every rank's ids, so every rank
        counts the same number), ``calls``,
        ``token_count_mismatches`` (calls in which some rank's T differed from this rank's:
        the layer needs the same T everywhere and computes wrong results otherwise; only
        ``check=True`` refuses such a call before it runs); training contexts add
        ``activations`` (:meth:`ActivationBuffer.stats`); contexts with their own CUDA
        graphs ``graphs`` (their counts, :mod:`distmoe.ops.graphs`).
        """
        self.check_open()
        if self.transport in ("nccl", "hierarchical"):  # the inner context's counters
            out = self.inner.stats()
            out.update(rank=self.rank, transport=self.transport,
                       invalid_ids=int(self._invalid_ids))
            return out
        last, mx, dropped, invalid, calls, mismatches = (int(v)
                                                         for v in self._counters.tolist())
        pull_tensors = [self._pulled_ptrs]
        if self.ep_size > 1:
            pull_tensors += [self._pulled, self._pull_flags]
            if hasattr(self, "_block_peer"):
                pull_tensors += [self._block_peer, self._w13_order, self._w13_positions,
                                 self._w13_starts]
        pull = sum(t.nbytes for t in pull_tensors)
        out = dict(rank=self.rank, transport=self.transport, receive_bound=self.receive_bound,
                   device_rows=self.device_rows, row_capacity=self.row_capacity,
                   pull_buffer_bytes=pull,
                   last_recv_rows=last, max_recv_rows=mx,
                   dropped_rows=dropped, invalid_ids=invalid, calls=calls,
                   token_count_mismatches=mismatches)
        if self.activations is not None:
            out["activations"] = self.activations.stats()
        if self.scratch_range is not None:
            out["scratch_tiers"] = self.scratch_range.tier_bytes
        if self.graphs is not None:
            out["graphs"] = self.graphs.stats()
        return out

    def _bound_factor(self) -> tuple[str, float]:
        """The name and value of the config factor that sets :attr:`receive_bound`."""
        if self.cfg.total_scratch_factor is not None:
            return "total_scratch_factor", self.cfg.total_scratch_factor
        return "device_scratch_factor", self.cfg.device_scratch_factor

    def _check_bound(self, y: torch.Tensor) -> None:
        """``check`` mode, after a call: whether any rank saw invalid ids or dropped routes
        in this call (counters compared with the previous check), shared over the group so
        that every rank raises together (a rank left alone would wait in the next collective).
        A training call's layer is taken back out of its slot first (its output ``y`` is
        lost with the error), on every rank alike."""
        s = self.stats()
        seen = self._bound_seen
        invalid, dropped = s["invalid_ids"] - seen[0], s["dropped_rows"] - seen[1]
        self._bound_seen = (s["invalid_ids"], s["dropped_rows"])
        problem = None
        if invalid:
            problem = ("ValueError", f"rank {self.rank}: {invalid} expert ids outside "
                       f"[-1, {self.cfg.num_experts}) were seen (treated as inactive)")
        elif s["last_recv_rows"] > self.receive_bound or dropped:
            factor, value = self._bound_factor()
            problem = ("RuntimeError",
                       f"rank {self.rank} received {s['last_recv_rows']} rows, above its "
                       f"receive bound of {self.receive_bound} rows ({factor} {value:g} "
                       f"x T_max*K {self.cfg.balanced_rows}, at most EP*T_max*min(K, "
                       f"E_local) = {self.cfg.max_possible_rows(self.ep_size)}); "
                       f"{dropped} routes were not executed. Raise {factor}, up to that "
                       "maximum.")
        outcomes = gather_objects(problem, self.group, self.ep_size)
        bad = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not bad:
            return
        record = getattr(y.grad_fn, "record", None)  # MoEFunction's ctx of a training call
        if record is not None:  # every rank alike: the layer's output is lost with the error
            self.activations.abandon_layer(record)
        if problem is not None:
            raise (ValueError if problem[0] == "ValueError" else RuntimeError)(problem[1])
        r, (kind, msg) = bad[0]
        raise RuntimeError(f"rank {r} failed the check after the call ({kind}: {msg}); every "
                           "rank stops (check=True)")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """*Collective.* Free the heap buffers (idempotent); the context is unusable after."""
        if self._closed:
            return
        self._closed = True
        if self.transport in ("nccl", "hierarchical"):
            self.inner.close()
            return
        if self.graphs is not None:
            self.graphs.clear()
            self.graphs.pool.clear()
        if self.scratch_range is not None:
            if self.device.type == "cuda":  # no kernel may still use the pages
                torch.cuda.synchronize(self.device)
            self.scratch_range.close()
        self.heap.close()

    def check_open(self) -> None:
        """RuntimeError if this context is closed, or unusable after a failed barrier."""
        if self._closed:
            raise RuntimeError("this MoEContext is closed")
        if self.heap.failed is not None:
            raise RuntimeError(f"this MoEContext is unusable: {self.heap.failed}")

    # ------------------------------------------------------------------ the plan
    def explain(self, tokens: int | None = None) -> str:
        """The kernel plan of this context as text: every kernel and launch config its
        calls use, the layer switches, and for a call of ``tokens`` tokens (default
        ``cfg.max_tokens``) the per-call choices (EP > 1: whether every peer token is copied,
        W13 in two launches). Host arithmetic only."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                                   or not 0 <= tokens <= self.cfg.max_tokens):
            raise ValueError(f"tokens ({tokens!r}) must be an int in [0, max_tokens = "
                             f"{self.cfg.max_tokens}]")
        if self.transport in ("nccl", "hierarchical"):
            nodes = self.ep_size // self.node_size
            return (f"transport: {self.transport} (all-gather over {nodes} "
                    f"{'ranks' if self.node_size == 1 else 'nodes'}, a layer of "
                    f"{self.node_size} rank(s) over {nodes} x {self.cfg.max_tokens} tokens, "
                    "reduce-scatter; distmoe.ops.transport)\n"
                    + self.inner.explain(None if tokens is None else tokens * nodes))
        text = f"transport: {self.transport}\n" + self.plan.describe(self.cfg, tokens)
        if self.scratch_range is not None:
            tiers = self.scratch_range.tier_bytes
            text += (f"\nreceive bound: {self.receive_bound} rows, h2 scratch of the first "
                     f"{self.device_rows} in device memory ({tiers['device']:,} B), the rest "
                     f"in pinned host pages ({tiers['host']:,} B; total_scratch_factor)")
        if self._lowp is not None:
            text += "\n" + self._describe_lowp()
        return text

    def _describe_lowp(self) -> str:
        """The low-precision kernels of :meth:`explain` (the bf16 plan above covers routing,
        the gather table and the combine; the expert GEMMs are these)."""
        s = self._lowp
        fmt = getattr(s, "format", self.cfg.precision)
        mode = (("training; " if self.cfg.training else "inference; ")
                + ("eager calls replayed from its CUDA graphs" if self.graphs is not None
                   else "every call eager"))
        lines = [f"precision: {self.cfg.precision}, operand format {fmt} ({mode})"]
        if fmt in ("nvfp4", "mxfp4"):
            lines.append(f"  {fmt:<10} Triton FP4-weight grouped GEMM (kernels/scaled/nvfp4)")
        else:
            lines.append("  gemms      block-scaled grouped GEMM (kernels/scaled: Triton, or "
                         "the Gluon form where a config says gluon=True)")
        named = [("w13", s.w13_config), ("w2", s.w2_config)]
        if getattr(s, "decode", None) is not None:  # FP4: calls below decode_rows per expert
            lines.append(f"  (calls under {s.decode_rows} rows per local expert: the "
                         "transposed configs below)")
            named += [("w13 decode", s.decode[0]), ("w2 decode", s.decode[1])]
        wgrads = []
        if self._lowp_train is not None:
            t = self._lowp_train
            named += [("w13 h1", t.w13_h1), ("w2 dgrad", t.w2_dgrad), ("w13 dgrad", t.w13_dgrad)]
            wgrads = [("w13 wgrad", t.w13_wgrad), ("w2 wgrad", t.w2_wgrad)]
        for name, c in named:
            lines.append(f"  {name:<10} block_m={c.block_m}, block_n={c.block_n}, "
                         f"block_k={c.block_k}, num_warps={c.num_warps}, "
                         f"num_stages={c.num_stages}, group_m={c.group_m}"
                         + (", gluon" if c.gluon else "")
                         + (", transposed" if getattr(c, "swap_ab", False) else ""))
        for name, c in wgrads:
            lines.append(f"  {name:<10} " + (
                "bf16 (the plan's WGRAD above)" if c is None else
                f"FP8, token-axis operands (kernels/scaled/wgrad): block_m={c.block_m}, "
                f"block_n={c.block_n}, num_stages={c.num_stages}"
                + (", gluon" if c.gluon else "")))
        return "\n".join(lines)

    def __enter__(self) -> MoEContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_host_tier(cfg: MoEConfig, asked: str, resolved: str) -> None:
    """ValueError where ``cfg.total_scratch_factor`` asks for host-backed scratch that this
    context cannot give: it serves bf16 inference on the peer transport (its one row-sized
    scratch, h2, is this rank's own; ``asked`` / ``resolved``: the transport argument and
    what it resolved to). A training context's scratch rows and slots are written by peers
    (route gradients, returned routes), and host-backed VMM pages cannot be shared with
    them; the low-precision scratch is device memory."""
    if cfg.total_scratch_factor is None:
        return
    if resolved != "peer":
        raise ValueError(f"total_scratch_factor ({cfg.total_scratch_factor:g}): host-backed "
                         "(VMM) scratch needs the peer transport, this context resolved "
                         f"{asked!r} to {resolved!r}; leave it None")
    why = None
    if cfg.training:
        why = ("a training context's scratch rows and slots are written by its peers, and "
               "host-backed pages cannot be mapped by them")
    elif cfg.precision != "bf16":
        why = f"the {cfg.precision} layer's scratch is device memory only"
    if why is not None:
        raise ValueError(f"total_scratch_factor ({cfg.total_scratch_factor:g}): host-backed "
                         f"(VMM) scratch serves bf16 inference only: {why}; leave it None")


def _shifted_returns(tables, deltas_EP: torch.Tensor, routes_per_rank: int) -> torch.Tensor:
    """``tables.scatter_ptrs`` with each row's return address shifted by its owner's entry
    of ``deltas_EP`` (int64 [EP], device values); null rows stay 0. A few elementwise ops
    over the ``R_cap`` rows, no host synchronisation."""
    route = tables.route_of_row
    owner = torch.where(route >= 0, route, 0) // routes_per_rank
    return tables.scatter_ptrs + torch.where(route >= 0, deltas_EP[owner], 0)
