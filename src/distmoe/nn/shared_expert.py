"""The shared expert: a dense SwiGLU branch beside the routed experts, added to their output.

DeepSeek-V3 and Qwen2-MoE send every token through one dense SwiGLU MLP (the "shared
expert") besides its top-K routed experts and add the two outputs; Qwen2-MoE scales the
shared output by a per-token sigmoid gate. Legend: T tokens of this rank, D hidden, F_s the
shared expert's width. Per call, with plain torch matmuls (fp32 accumulation, bf16 output):

    h1_T2F  = x_TD @ w13_2FD.reshape(2 F_s, D)^T          bf16   [gate | up]
    h2_TF   = silu(h1[:, :F_s]) * h1[:, F_s:]             fp32 math, one bf16 rounding
    h3_TD   = h2_TF @ w2_DF^T                             bf16
    gated:  s_T1 = sigmoid(x_TD @ gate_1D^T)              logit bf16, sigmoid fp32
    y_TD    = bf16(float(routed_TD) + s_T1 * float(h3_TD))     fp32 add, one bf16 rounding

(without the gate ``s = 1`` and the add is torch's bf16 ``+``, which computes in fp32 and
rounds once). ``routed`` is the routed layer's output, already a bf16 rounding of its fp32
combine, so the routed part is rounded twice, the shared part (h3 as the layer's h3) once.

Memory (training): autograd keeps x and the weights for the matmuls' backward, h1 (the SwiGLU
backward recomputes silu from it, no fp32 copy is saved) and h2; with the gate also h3 and
the logit. Nothing is allocated for the forward beyond h1, h2, h3 (and the logit, s) and y.

Streams (:func:`with_shared_expert`): with a side stream (CUDA) the shared branch runs on it,
forked from the current stream before the routed call and joined after it, so its GEMMs fill
the SMs the routed call leaves idle (its barriers, dispatch and combine). Its kernels wait on
nothing, so they cannot hold up the routed call's device waits (the Mega kernel's included)
for longer than they run. In backward autograd runs each shared-branch op on the stream its
forward ran on, so the two branches overlap there too, with autograd's own cross-stream
syncs. No host synchronisation anywhere; under CUDA-graph capture the fork and join are
captured as graph edges. Without a stream (CPU, tracing) both run inline on one stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["add_shared", "shared_expert", "shared_expert_ref", "with_shared_expert"]


class _SwiGLU(torch.autograd.Function):
    """h2 = bf16(silu(g) * up) computed in fp32 from h1 = [g | up]; saves only h1 (bf16)."""

    @staticmethod
    def forward(ctx, h1_T2F):
        F_s = h1_T2F.shape[-1] // 2
        g, up = h1_T2F[:, :F_s].float(), h1_T2F[:, F_s:].float()
        ctx.save_for_backward(h1_T2F)
        return (F.silu(g) * up).to(h1_T2F.dtype)

    @staticmethod
    def backward(ctx, gh2_TF):
        (h1_T2F,) = ctx.saved_tensors
        F_s = h1_T2F.shape[-1] // 2
        g, up = h1_T2F[:, :F_s].float(), h1_T2F[:, F_s:].float()
        gh2 = gh2_TF.float()
        sig = torch.sigmoid(g)
        d_gate = gh2 * up * sig * (1 + g * (1 - sig))  # d silu(g)/dg = s (1 + g (1 - s))
        d_up = gh2 * (g * sig)
        return torch.cat([d_gate, d_up], dim=-1).to(h1_T2F.dtype)


class _GatedAdd(torch.autograd.Function):
    """y = bf16(float(routed) + sigmoid(float(logit)) * float(h3)); saves h3 and the logit."""

    @staticmethod
    def forward(ctx, routed_TD, h3_TD, logit_T1):
        s = torch.sigmoid(logit_T1.float())
        ctx.save_for_backward(h3_TD, logit_T1)
        return torch.addcmul(routed_TD.float(), s, h3_TD.float()).to(routed_TD.dtype)

    @staticmethod
    def backward(ctx, gy_TD):
        h3_TD, logit_T1 = ctx.saved_tensors
        s = torch.sigmoid(logit_T1.float())
        gy = gy_TD.float()
        g_routed = gy_TD if ctx.needs_input_grad[0] else None  # y has routed's dtype
        g_h3 = (gy * s).to(h3_TD.dtype) if ctx.needs_input_grad[1] else None
        g_logit = None
        if ctx.needs_input_grad[2]:
            g_logit = ((gy * h3_TD.float()).sum(-1, keepdim=True) * s * (1 - s)).to(
                logit_T1.dtype)
        return g_routed, g_h3, g_logit


def shared_expert(x_TD: torch.Tensor, w13_2FD: torch.Tensor, w2_DF: torch.Tensor,
                  gate_1D: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared branch on the current stream: ``(h3 [T, D], logit [T, 1] or None)`` in x's
    dtype (see the module docstring); differentiable in every argument."""
    h1_T2F = F.linear(x_TD, w13_2FD.flatten(0, 1))
    h3_TD = F.linear(_SwiGLU.apply(h1_T2F), w2_DF)
    logit_T1 = None if gate_1D is None else F.linear(x_TD, gate_1D)
    return h3_TD, logit_T1


def add_shared(routed_TD: torch.Tensor, h3_TD: torch.Tensor,
               logit_T1: torch.Tensor | None = None) -> torch.Tensor:
    """``y = routed + h3`` (or ``routed + sigmoid(logit) * h3``): fp32 math, one rounding to
    ``routed``'s dtype; differentiable."""
    if logit_T1 is None:
        return routed_TD + h3_TD  # bf16 + bf16: torch adds in fp32 (opmath), rounds once
    return _GatedAdd.apply(routed_TD, h3_TD, logit_T1)


def with_shared_expert(routed: Callable[[], torch.Tensor], x_TD: torch.Tensor,
                       w13_2FD: torch.Tensor, w2_DF: torch.Tensor,
                       gate_1D: torch.Tensor | None = None, *,
                       stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """``routed() + shared_expert(x, ...)`` (:func:`add_shared`). ``routed`` runs the routed
    layer on the current stream (e.g. ``lambda: ctx(x, ids, scores, w13, w2)``).

    With ``stream`` (a CUDA stream of x's device) the shared branch is issued first, on
    ``stream`` forked from the current stream, then ``routed()`` on the current stream, then
    the current stream waits for ``stream`` and adds. Without it (CPU, tracing) ``routed()``
    runs first, so its input checks speak before the shared matmuls', then the branch.
    """
    if stream is None:
        routed_TD = routed()
        h3_TD, logit_T1 = shared_expert(x_TD, w13_2FD, w2_DF, gate_1D)
        return add_shared(routed_TD, h3_TD, logit_T1)
    current = torch.cuda.current_stream(x_TD.device)
    stream.wait_stream(current)  # fork: the side stream sees x and the weights as written
    with torch.cuda.stream(stream):
        h3_TD, logit_T1 = shared_expert(x_TD, w13_2FD, w2_DF, gate_1D)
    # x was allocated on the current stream and is read on the side stream (in forward, and
    # in backward, where autograd reruns the matmuls' backward there): its memory must not
    # be handed to the current stream again before those reads. (The weights are parameters,
    # long-lived; the allocator skips memory it does not own, e.g. ctx.input_buffer's.)
    x_TD.record_stream(stream)
    routed_TD = routed()
    current.wait_stream(stream)  # join
    # h3 and the logit were allocated on the side stream and are read on the current one
    for t in (h3_TD, logit_T1):
        if t is not None:
            t.record_stream(current)
    return add_shared(routed_TD, h3_TD, logit_T1)


def shared_expert_ref(x_TD: torch.Tensor, w13_2FD: torch.Tensor, w2_DF: torch.Tensor,
                      gate_1D: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch shared expert as a Hugging Face model computes it, every op in x's dtype
    (CPU or GPU, any float dtype; fp64 for an oracle): ``(silu(x g^T) * (x u^T)) @ w2^T``,
    times ``sigmoid(x @ gate^T)`` when gated. Returns [T, D] in x's dtype."""
    gate_proj, up_proj = w13_2FD[0], w13_2FD[1]
    out = (F.silu(x_TD @ gate_proj.t()) * (x_TD @ up_proj.t())) @ w2_DF.t()
    if gate_1D is not None:
        out = torch.sigmoid(x_TD @ gate_1D.t()) * out
    return out
