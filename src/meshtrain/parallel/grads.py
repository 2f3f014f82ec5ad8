"""Gradient-norm clipping across any layout: plain tensors, DTensors on several meshes, pipeline stages."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """The global L2 norm of all gradients (as if the model were on one device), and clip to it.

    Gradients are grouped by mesh, since one model can hold plain tensors, FSDP shards and TP
    shards at once; each group's norm is completed with `full_tensor()`, and pipeline stages add
    their squared norms over the pp group.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    device = next(iter(params)).device if params else torch.device("cpu")
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if math.isfinite(max_norm):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
