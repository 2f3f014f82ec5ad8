"""Data parallelism with replicas (ZeRO-0 and ZeRO-1; ZeRO-1 shards the optimizer states in optim.py)."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, ignored: set[nn.Parameter] = frozenset()) -> nn.Module:
    """Wrap a materialised model in DDP over the data-parallel group. Gradients are averaged in
    buckets overlapped with backward; `gradient_as_bucket_view` saves one gradient copy. `ignored`:
    parameters that differ between ranks by design (expert parallelism's experts). Buffers are not
    broadcast from rank 0 before each forward: every buffer is either the same on every rank (rotary
    tables) or this rank's own (an MoE layer's token counts, summed over the ranks at the step's end)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, p in model.named_parameters() if p in ignored]
    )
    device_ids = None if dp_mesh.device_type == "cpu" else [next(model.parameters()).device.index]
    # torch 2.13 renamed broadcast_buffers (its old name warns); older releases know only that one
    takes_new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    return DistributedDataParallel(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        **{"forward_sync_buffers" if takes_new_name else "broadcast_buffers": False},
    )


@torch.no_grad()
def average_gradients(params: list[torch.Tensor], group, bucket_bytes: int = 64 * 2**20) -> None:
    """Average gradients over `group` after backward, in flat buckets: data parallelism for
    pipeline stages, whose several forwards per backward DDP's reducer miscounts (it fails its
    bucket rebuild after the first step in torch 2.13)."""
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    for i, grad in enumerate(grads):
        bucket.append(grad)
        if sum(g.numel() * g.element_size() for g in bucket) >= bucket_bytes or i == len(grads) - 1:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket = []
