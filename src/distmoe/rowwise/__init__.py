"""Rowwise PUT/GET over the symmetric heap: a lower-level API than
:class:`distmoe.MoEContext`, for frameworks that schedule their own MoE phases
(docs/rowwise.md).

* :class:`Buffers` (collective): the heap buffers ``out`` / ``expert_out`` (bf16
  ``[rows, hidden]`` on every rank), their gradient twins and bad-route counters.
* :func:`dispatch_put`: each route ``(t, k)`` pushes ``input[t]`` (times ``probs[t, k]``)
  into row ``dst_rows[t, k]`` of ``out`` on rank ``dst_ranks[t, k]``.
* :func:`combine_get` / :func:`combine_get_fused`: each route pulls a row back; each token's
  K routes are reduced in fp32 (weighted by ``probs``); the fused form in one kernel.
* :func:`gather_get`: one-to-one pull.
* :func:`dispatch_put_scaled` / :func:`combine_get_scaled`: MXFP8 rows (E4M3 values and E8M0
  scales in two buffers of ``Buffers(scaled=True)``), moved bit for bit, dequantised and
  reduced on arrival (:mod:`distmoe.rowwise.scaled`).
* :func:`expert_major_rows` (collective): each route's destination rank and row, laid out by
  expert on every rank, from an all-gathered histogram.
* :func:`grouped_mm`: torch._grouped_mm's grouped GEMM (bf16, differentiable), its result
  and input gradient written into caller buffers (``out``, ``input_grad_out``);
  :func:`scaled_grouped_mm_q`: the same shapes on prequantised FP8 operands (forward);
  :func:`scaled_grouped_mm`: on bf16 operands quantised per call, differentiable (FP8
  forward and input gradient, bf16 weight gradient, optionally into a ``wgrad_sink``).
* :func:`scaled_expert_mlp`: scaled dispatch -> W13 -> SwiGLU -> W2 -> scaled combine as one
  autograd node with its adjoint backward, optionally recomputing SwiGLU in backward
  (:mod:`distmoe.rowwise.fused`).

The bf16 calls are differentiable: dispatch's backward is a combine GET, the combines' and the
gather's backward a (weighted) dispatch PUT. A negative rank or row marks an invalid route
(PUT skips it, GET reads zeros); a rank >= world size or a row >= rows is a bad route,
dropped and counted (``Buffers.stats()``), or refused with ``Buffers(check=True)``.
"""

from .buffers import Buffers
from .combine import combine_get, combine_get_fused, gather_get
from .dispatch import dispatch_put
from .fused import scaled_expert_mlp
from .grouped import grouped_mm, scaled_grouped_mm, scaled_grouped_mm_q
from .layout import expert_major_rows
from .scaled import combine_get_scaled, dispatch_put_scaled

__all__ = ["Buffers", "combine_get", "combine_get_fused", "combine_get_scaled", "dispatch_put",
           "dispatch_put_scaled", "expert_major_rows", "gather_get", "grouped_mm",
           "scaled_expert_mlp", "scaled_grouped_mm", "scaled_grouped_mm_q"]
