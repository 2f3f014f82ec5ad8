"""The global gradient norm across any layout: plain tensors, DTensors on several meshes, pipeline
stages. Clipping itself happens inside the fused AdamW kernel (see `train.train_step`)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from meshtrain.dtensor import is_dtensor


def global_grad_norm(params: list[torch.Tensor], pp_group=None) -> torch.Tensor:
    """The global L2 norm of all gradients, as if the model were on one device.

    Gradients are grouped by mesh, since one model can hold plain tensors, FSDP shards and TP
    shards at once; each group's norm is completed with `full_tensor()`, and pipeline stages add
    their squared norms over the pp group.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[p.grad.device_mesh if is_dtensor(p.grad) else None].append(p)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    device = next(iter(params)).device if params else torch.device("cpu")
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()
