"""Context parallelism: each sequence split over the cp ranks, attention by all-to-all (DeepSpeed-Ulysses,
Jacobs et al. 2023).

Every rank embeds, projects, normalises and runs the MLP on its contiguous slice of S / cp tokens.
Attention needs the whole sequence, so around the attention core an all-to-all trades the sequence
split for a head split: (batch, heads, S / cp, d) on each rank -> (batch, heads / cp, S, d), attention
over the full sequence with any mask (causal, per-document), and the reverse all-to-all. Each rank
sees every query position, so the causal work is the same on every rank with no load balancing
(ring attention's zig-zag split exists for that imbalance) and document masks need nothing special.
The price: heads / cp must be whole (per TP slice; with fewer key/value heads than cp ranks each is
copied to the ranks whose queries use it, as Megatron does), and the all-to-all moves 4 x S x hidden / cp
elements a layer each way, against ring attention's cp - 1 key/value passes.

Why not torch's own `context_parallel` (ring attention over DTensor): in torch 2.13 it maps only the
CUDA attention kernels (`_scaled_dot_product_{flash,efficient,cudnn}_attention`); on a CPU it is
refused ("no sharding strategy registered"), and it supports neither boolean document masks nor the
grouped-query SDPA this model calls. The all-to-all runs wherever the process group runs (gloo,
NCCL) and is differentiable through torch's functional collectives, which also trace under compile.

`apply_cp` sets the slice a rank holds on the model (`Llama.forward` embeds its part of the tokens,
each attention rotates by its part of the positions) and wraps each attention's core; `shard_targets` gives the loss the
same slice of the targets. Gradients then average over DP x CP and ZeRO shards over dp_shard x cp
(parallel/mesh.py): for the optimizer, context-parallel ranks are data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.parallel.activation_checkpoint import unwrapped


def seq_to_heads(x: torch.Tensor, group, ranks: int) -> torch.Tensor:
    """(batch, heads, S / cp, d), this rank's slice of the sequence -> (batch, heads / cp, S, d), its
    share of the heads over the whole sequence (slices in rank order)."""
    batch, heads, seq, dim = x.shape
    send = x.reshape(batch, ranks, heads // ranks, seq, dim).transpose(0, 1).contiguous()
    received = all_to_all_single_autograd(send.flatten(0, 1), None, None, group)
    received = received.view(ranks, batch, heads // ranks, seq, dim)  # dim 0: whose slice of the sequence
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // ranks, ranks * seq, dim)


def heads_to_seq(x: torch.Tensor, group, ranks: int) -> torch.Tensor:
    """The reverse of seq_to_heads: (batch, heads / cp, S, d) -> (batch, heads, S / cp, d)."""
    batch, heads, seq, dim = x.shape
    send = x.reshape(batch, heads, ranks, seq // ranks, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = all_to_all_single_autograd(send.flatten(0, 1), None, None, group)
    received = received.view(ranks, batch, heads, seq // ranks, dim)  # dim 0: whose share of the heads
    return received.transpose(0, 1).reshape(batch, ranks * heads, seq // ranks, dim)


class UlyssesAttention:
    """An attention core (q, k, v, mask) -> out over (batch, heads, seq, d) run on the whole
    sequence for heads / cp of the heads: all-to-all in, the core, all-to-all out."""

    def __init__(self, core: Callable, group, ranks: int):
        self.core, self.group, self.ranks = core, group, ranks

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        if k.shape[1] % self.ranks:  # fewer key/value heads than ranks: each rank gets a copy of its group's
            k, v = (t.repeat_interleave(self.ranks // k.shape[1], dim=1) for t in (k, v))
        q, k, v = (seq_to_heads(t, self.group, self.ranks) for t in (q, k, v))
        return heads_to_seq(self.core(q, k, v, mask), self.group, self.ranks)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Split the sequence over `cp_mesh` in place: the model keeps this rank's slice of each
    sequence, and every attention gathers the sequence for a share of its heads."""
    ranks, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    group = cp_mesh.get_group()
    model.sequence_slice = (rank, ranks)
    for block in model.layers.values():
        attention = unwrapped(block).attention
        attention.sequence_slice = (rank, ranks)
        attention.attend = UlyssesAttention(attention.attend, group, ranks)


class ShardedTargets:
    """A loss function (logits, targets) -> summed loss, given this rank's slice of the targets: the
    logits are of the rank's S / cp tokens, the loader's targets of the whole sequence."""

    def __init__(self, loss_fn: Callable, rank: int, ranks: int):
        self.loss_fn, self.rank, self.ranks = loss_fn, rank, ranks

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, targets.chunk(self.ranks, dim=1)[self.rank])


def shard_targets(loss_fn: Callable, cp_mesh: DeviceMesh | None) -> Callable:
    """`loss_fn` taking the whole sequence's targets under context parallelism, itself otherwise."""
    if cp_mesh is None:
        return loss_fn
    return ShardedTargets(loss_fn, cp_mesh.get_local_rank(), cp_mesh.size())
