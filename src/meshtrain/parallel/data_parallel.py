"""Data parallelism with replicas: DDP (ZeRO-0) and, with ZeroRedundancyOptimizer, ZeRO-1."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Wrap a materialised model in DDP over the data-parallel group. Gradients are averaged in
    buckets overlapped with backward; `gradient_as_bucket_view` saves one gradient copy."""
    device_ids = None if dp_mesh.device_type == "cpu" else [next(model.parameters()).device.index]
    return DistributedDataParallel(
        model, process_group=dp_mesh.get_group(), device_ids=device_ids, gradient_as_bucket_view=True
    )
