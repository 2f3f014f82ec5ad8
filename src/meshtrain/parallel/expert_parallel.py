"""Expert parallelism: each MoE layer's experts split over the ep ranks of a data-parallel group.

Each rank routes its own tokens (model/moe.py: router, capacity, the (token, expert) pairs sorted by
expert), then the pairs travel to the rank holding their expert and back:

    counts   all-to-all: how many pairs each rank sends each of my experts
    dispatch all-to-all: the pairs' hidden states, each rank's in expert order
    regroup  by my expert (from every rank), run my experts on their groups, regroup back by rank
    combine  all-to-all back: each pair to the rank it came from, where the router's weights sum them

Both all-to-alls are differentiable (backward sends the gradients the other way). An expert's weights
are a DTensor sharded on dim 0 over the ep mesh, so that checkpoints record the split and load into any
other EP degree or none. Its gradient sums the contributions of every ep rank's tokens; the ranks that
hold the same experts (the other data-parallel ranks) add theirs, and the sum is divided by dp x cp as
DDP and FSDP average the other gradients. Under ZeRO-2/3 with such ranks FSDP shards the experts over
them and does that (parallel/fully_shard.py); otherwise DDP and FSDP leave the experts alone, and
`reduce_expert_gradients` does it after backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from meshtrain.model.moe import GroupedExperts


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Split every MoE layer's experts over `ep_mesh` (on the meta device, before materialising);
    returns the expert parameters, which DDP must leave alone (and FSDP shard apart, or leave alone)."""
    params = []
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, param in list(module.named_parameters(recurse=False)):
                shard = nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)]), param.requires_grad)
                module.register_parameter(name, shard)
                params.append(shard)
            module.dispatch = AllToAllDispatch(ep_mesh.get_group(), ep_mesh.size())
    return params


class AllToAllDispatch:
    """Runs `compute(x, counts)` of this rank's experts on the pairs every ep rank routed to them."""

    def __init__(self, group, ranks: int):
        self.group, self.ranks = group, ranks

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        """x (pairs, dim) sorted by expert, `counts[e]` of them for each of all n_experts -> the
        experts' outputs for x, in x's order."""
        local = len(counts) // self.ranks
        received = torch.empty_like(counts)  # [rank r's pairs for my expert e] by (r, e)
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(self.ranks, local).sum(1).tolist()
        blocks = received.view(self.ranks, local)
        receive = blocks.sum(1).tolist()
        pairs = all_to_all_single_autograd(x, receive, send, self.group)
        # (rank, expert)-ordered blocks to (expert, rank) order, so that each expert's rows are together
        by_rank = list(torch.split(pairs, blocks.flatten().tolist()))
        by_expert = torch.cat([by_rank[r * local + e] for e in range(local) for r in range(self.ranks)])
        out = compute(by_expert, blocks.sum(0))
        back = list(torch.split(out, blocks.T.flatten().tolist()))
        out = torch.cat([back[e * self.ranks + r] for r in range(self.ranks) for e in range(local)])
        return all_to_all_single_autograd(out, send, receive, self.group)


@torch.no_grad()
def reduce_expert_gradients(params: list[torch.Tensor], replica_group, dp_cp: int) -> None:
    """The experts' gradients as one process's: summed over the ranks holding the same experts, divided
    by the dp x cp ranks every loss is a share of (see the module docstring)."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if replica_group is not None:
        dist.all_reduce(flat, group=replica_group)
    flat /= dp_cp
    torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])
