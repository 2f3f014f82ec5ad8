"""Attention with the CPU flash kernel's forward and a backward recomputed from matmuls.

torch's CPU flash-attention backward is slow at short sequences: on a 2-core Xeon with AMX it took
16 of the 19 ms of `small`'s attention (8 x 256 tokens, 10 heads of 64, bf16), 5.6x its forward,
while the same gradients from the textbook recomputation (the scores again from q k^T and the
forward's log-sum-exp, then four batched matmuls) took 9 ms compiled. Under torch.compile the
elementwise work between those matmuls fuses into a few kernels; eagerly it does not, and there the
recomputation was 3x slower than the kernel. It also holds the batch's whole score matrix (batch x
heads x seq x seq in fp32) for one layer's backward, where the flash kernel holds a block: it is
used only within MAX_SCORES, and only where job/arithmetic.py timed it faster at the run's own
shapes (`training.attention_backward`), for causal attention and the dense document masks of a
compiled CPU step (model/masks.py). The forward, and so the numbers of the loss, are the kernel's;
the gradients agree with it to rounding.
"""

from __future__ import annotations

import torch

from meshtrain.dtensor import is_dtensor

# Scores of one layer's backward held at once (batch x heads x seq x seq, fp32: 256 MiB); beyond it
# the flash kernel's backward, whose memory does not grow with seq^2.
MAX_SCORES = 2**26


def applies(q: torch.Tensor) -> bool:
    """Whether (batch, heads, seq, head_dim) q's backward is one to recompute: gradients wanted, a
    plain CPU tensor (not a DTensor), and the score matrix within MAX_SCORES."""
    batch, heads, seq, _ = q.shape
    return q.requires_grad and q.device.type == "cpu" and not is_dtensor(q) and batch * heads * seq * seq <= MAX_SCORES


class _RecomputedAttention(torch.autograd.Function):
    """softmax(q k^T * scale, masked) v with GQA (k and v have n_kv_heads; query head h uses kv
    head h // (n_heads / n_kv_heads)). `allowed`: a (batch, 1, seq, seq) bool mask of the keys each
    query sees (document masking), or None: causal. Saves q, k, v, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, allowed):
        scale = q.shape[-1] ** -0.5
        bias = (
            None
            if allowed is None
            else torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, -torch.inf)
        )
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, allowed is None, attn_mask=bias, scale=scale
        )[:2]
        ctx.save_for_backward(q, k, v, out, lse, allowed)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, allowed = ctx.saved_tensors
        batch, heads, seq, head_dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        # the query heads that share a kv head stacked along the rows: one matmul per kv head
        rows = (batch, kv_heads, group * seq, head_dim)
        q_g, out_g, grad_g = q.reshape(rows), out.reshape(rows), grad_out.reshape(rows)
        if allowed is None:
            position = torch.arange(seq, device=q.device)
            hidden = position.view(1, -1) > position.repeat(group).view(-1, 1)
        else:
            hidden = ~allowed.repeat(1, 1, group, 1)
        scores = (q_g @ k.transpose(-1, -2)).float() * ctx.scale
        probs = torch.exp(scores - lse.reshape(batch, kv_heads, group * seq, 1)).masked_fill(hidden, 0.0)
        grad_v = probs.to(q.dtype).transpose(-1, -2) @ grad_g
        grad_probs = (grad_g @ v.transpose(-1, -2)).float()
        row_dot = (grad_g.float() * out_g.float()).sum(-1, keepdim=True)  # sum_j P_ij dP_ij
        grad_scores = (probs * (grad_probs - row_dot) * ctx.scale).to(q.dtype)
        grad_q = (grad_scores @ k).reshape(q.shape)
        grad_k = grad_scores.transpose(-1, -2) @ q_g
        return grad_q, grad_k, grad_v, None


def recomputed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention on (batch, heads, seq, head_dim) CPU tensors, causal or under a (batch, 1, seq,
    seq) bool mask `allowed`, in autocast's dtype where autocast is on (as F.scaled_dot_product_attention
    would be)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast(device, enabled=False):
        return _RecomputedAttention.apply(q, k, v, allowed)
