"""Pipeline parallelism with `torch.distributed.pipelining`: split the layers into stages, one
schedule drives micro-batches through them.

Stages are cut from the full model (built on `meta`, so this costs nothing): a stage keeps its
layers (keeping their names, since `layers` is a ModuleDict), the first keeps the embedding and the
last the final norm and output. Placement: loop-style for gpipe/1f1b/interleaved/zero_bubble (rank r
holds stages r, r+pp, ...), V-style for zbv (rank r holds r and 2pp-1-r).

Tied embeddings (Llama 3.2, small Qwens) as Megatron ties them: the last stage keeps its own copy
of the embedding matrix as its output weight, initialised (or imported) equal to it; after each
backward the two gradients are summed between the first and last stage (`sum_tied_gradients`), so
both copies take the same update and stay equal, and the gradient norm counts the matrix once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.config import PP_SCHEDULES, SINGLE_STAGE_SCHEDULES
from meshtrain.layout import Layout, split_layers

# The classes of torch.distributed.pipelining.schedules, looked up when a pipeline is built: that
# package takes most of a second to import, which every process of a run without one would pay.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
assert tuple(SCHEDULES) == PP_SCHEDULES


def pipeline_stage_modules(model: nn.Module, layout: Layout, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage index, module) for each stage this rank holds, cut from a meta-device model."""
    n_stages = layout.n_stages
    layers = split_layers(len(model.layers), n_stages)
    parts = []
    for stage in layout.stage_ids(pp_rank):
        part = copy.deepcopy(model)
        keep = {str(i) for i in layers[stage]}
        for name in list(part.layers):
            if name not in keep:
                del part.layers[name]
        if stage != 0:
            part.tok_embeddings = None
        if stage != n_stages - 1:
            part.norm, part.output = None, None
        parts.append((stage, part))
    return parts


def tied_output(part: nn.Module) -> bool:
    """A last stage's output weight that is a copy of the first stage's embedding."""
    return part.args.tie_embeddings and part.tok_embeddings is None and part.output is not None


def sum_tied_gradients(parts: list[nn.Module], group) -> None:
    """Sum the gradients of the embedding (first stage) and of its copy (last stage's output):
    in place on a rank that holds both stages (zbv), over `group` (the two ranks) otherwise. Both
    are sharded alike (by rows, under TP and FSDP), so local shards line up once each gradient has
    its parameter's placement (TP leaves the embedding's gradient replicated)."""
    from torch.distributed.tensor import DTensor

    params = [part.tok_embeddings.weight for part in parts if part.tok_embeddings is not None]
    params += [part.output.weight for part in parts if tied_output(part)]
    local = []
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        local.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    if len(local) == 2:
        total = local[0] + local[1]
        local[0].copy_(total)
        local[1].copy_(total)
    elif local and group is not None:
        torch.distributed.all_reduce(local[0], group=group)


class ScaledLoss:
    """A schedule's loss_fn: the summed loss of a micro-batch times `scale`, set before each step (dp
    / targets in the global batch), so gradients are summed over micro-batches, not averaged; under
    fp16 also times the loss scale."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn, self.scale = loss_fn, 1.0
        self.scaler = None  # fp16 training: its LossScaler (train/loss_scale.py), set before each step

    def __call__(self, output, target):
        loss = self.loss_fn(output, target) * self.scale
        return self.scaler.scale(loss) if self.scaler is not None else loss


def build_schedule(
    parts: list[tuple[int, nn.Module]],
    n_stages: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    schedule: str,
    n_microbatches: int,
    loss_fn: ScaledLoss,
):
    """The schedule over this rank's stages; gradients are summed over micro-batches (`loss_fn`
    scales each one's loss)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [PipelineStage(module, idx, n_stages, device, group=pp_mesh.get_group()) for idx, module in parts]
    cls = getattr(schedules, SCHEDULES[schedule])
    first = stages[0] if schedule in SINGLE_STAGE_SCHEDULES else stages
    return cls(first, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
