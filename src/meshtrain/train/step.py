"""One training step and one validation pass, for every layout, with no host-device sync.

The loss is the mean over the global batch's target tokens (a target of IGNORE_INDEX, a token of
chat data the loss mask leaves out, does not count): each micro-batch contributes its summed
cross-entropy times dp / (targets in the global batch), so that the data-parallel average of the
gradients is the gradient of that mean, the same for 1 process or N and any micro-batch split.
The loader counts the global batch's targets on the host, so no collective or sync is needed.

inputs, targets, positions (this DP rank's slice)  -> the device, once per step (positions: each token's
                                                     within its document, or None: plain causal)
no PP: micro-batches of the layout's micro_batch_size, gradients accumulate; DDP/FSDP reduce on the last
PP:    the schedule drives the micro-batches through the stages
fp16:  each loss scaled before backward, the gradients unscaled after (train/loss_scale.py)
global grad norm -> fused AdamW (clips and skips inside its kernel) -> the LR schedule steps outside
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from contextlib import ExitStack, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.config import TrainingConfig
from meshtrain.data.windows import IGNORE_INDEX
from meshtrain.dtensor import is_dtensor
from meshtrain.layout import Layout
from meshtrain.model.lora import adapters_off
from meshtrain.optim import local_optimizer
from meshtrain.parallel import ParallelDims, ParallelModel
from meshtrain.parallel.data_parallel import average_gradients
from meshtrain.parallel.float8 import precompute_scales
from meshtrain.parallel.grads import global_grad_norm
from meshtrain.parallel.pipeline import sum_tied_gradients
from meshtrain.train.loss_scale import LossScaler
from meshtrain.train.preference import sequence_logps
from meshtrain.train.watchdog import phase


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the target tokens (IGNORE_INDEX ones left out)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def loss_scale(targets: torch.Tensor, n_targets: int | None, layout: Layout) -> float:
    """dp x cp / (targets in the global batch): the gradients average over the DP x CP ranks, and each
    context-parallel rank's loss is of its slice of the sequences. `n_targets`, or when None this
    rank's count (of whole sequences) times dp (right when every rank's slice holds as many, as with
    plain text)."""
    n = n_targets if n_targets is not None else int((targets != IGNORE_INDEX).sum()) * layout.dp
    return layout.dp_cp / max(1, n)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch to the device: asynchronous from pinned memory (the loader pins for a GPU); a
    tensor already there is returned as it is."""
    return t.to(device, non_blocking=t.is_pinned())


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # training.dtype -> its mixed-precision compute dtype


def step_context(model: ParallelModel, training: TrainingConfig, device: torch.device) -> ExitStack:
    """Vocabulary-parallel loss under TP; autocast for bf16 unless FSDP casts the parameters itself,
    and always for fp16: its narrow range needs autocast's fp32 ops (softmax, norms, reductions) even
    where FSDP has cast the parameters."""
    stack = ExitStack()
    if model.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel  # (TP loads DTensor; see dtensor.py)

        stack.enter_context(loss_parallel())
    if training.dtype == "fp16" or (training.dtype == "bf16" and not model.fsdp):
        stack.enter_context(torch.autocast(device.type, dtype=HALF[training.dtype]))
    return stack


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss_parallel) as a plain tensor."""
    return t.full_tensor() if is_dtensor(t) else t


def micro_batch_loss(
    model: ParallelModel, part, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The summed loss of one micro-batch: cross-entropy of its targets, or DPO's over its pairs
    after a reference pass (the adapters off, or the frozen copy of the base). `positions`: each
    token's within its document (document masking); None: plain causal (preference rows always)."""
    if model.preference is None:
        return model.loss_fn(part(x) if positions is None else part(x, positions=positions), y)
    with torch.no_grad():
        if model.reference is not None:  # a frozen copy of the base (full-weight DPO; no pipelines)
            reference = sequence_logps(model.reference[0](x), y)
        else:  # LoRA: the same weights with the adapters off
            with adapters_off(model.parts):
                reference = sequence_logps(part(x), y)
    return model.preference(part(x), y, reference)


def forward_backward(
    model: ParallelModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batch: int,
    device,
    scale: float,
    scaler: LossScaler | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradients of this rank's local batch; returns its part of the global mean loss (a tensor: no
    host sync), `scale` = dp / targets in the global batch. `scaler`: fp16's loss scale, applied to
    what backward sees (the gradients come out scaled), not to the loss returned. `positions`: the
    batch's document positions (None: plain causal)."""
    if model.schedule is not None:
        loss = pipeline_loss(
            model, inputs, targets, device, train=True, scale=scale, scaler=scaler, positions=positions
        )
        if model.grad_average_group is not None:
            experts = {id(p) for p in model.expert_params}
            average_gradients([p for p in model.parameters() if id(p) not in experts], model.grad_average_group)
        if model.ties_across_stages:
            sum_tied_gradients(model.parts, model.tied_group)
        reduce_expert_gradients(model)
        return loss
    (part,) = model.parts
    chunks = list(zip(inputs.split(micro_batch), targets.split(micro_batch), split_positions(positions, micro_batch)))
    total = torch.zeros((), device=device)
    for i, (x, y, p) in enumerate(chunks):
        last = i == len(chunks) - 1
        if hasattr(part, "set_requires_gradient_sync"):  # FSDP
            part.set_requires_gradient_sync(last)
        with nullcontext() if last or not hasattr(part, "no_sync") else part.no_sync():  # DDP
            loss = micro_batch_loss(model, part, x, y, p) * scale
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += local_value(loss.detach())
    reduce_expert_gradients(model)
    return total


def reduce_expert_gradients(model: ParallelModel) -> None:
    """Expert parallelism's experts, which neither DDP nor FSDP reduce (parallel/expert_parallel.py)."""
    if model.expert_params:
        from meshtrain.parallel.expert_parallel import reduce_expert_gradients as reduce

        reduce(model.expert_params, model.expert_replica_group, model.dp_cp)


def split_positions(positions: torch.Tensor | None, micro_batch: int) -> Iterable[torch.Tensor | None]:
    """A batch's positions split as its inputs are; None (plain causal) for every micro-batch."""
    return itertools.repeat(None) if positions is None else positions.split(micro_batch)


def clear_gradients(model: ParallelModel, optimizer, stable: bool) -> None:
    """Before a step's backward: gradients set to None (each micro-batch's first backward hands its
    gradient over instead of adding it to zeros), or with `stable` zeroed in buffers of their own,
    allocated once. CUDA graphs with more than one micro-batch need those: a gradient a graph's
    backward hands over lives in the graph's memory pool, which the next micro-batch's replay writes
    over (torch refuses to read it then); added into a buffer outside the pool, it survives."""
    if not stable:
        optimizer.zero_grad(set_to_none=True)
        return
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.zero_grad(set_to_none=False)


def train_step(
    model: ParallelModel,
    optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    layout: Layout,
    t: TrainingConfig,
    device: torch.device,
    context,
    pp_group=None,
    n_targets: int | None = None,
    scaler: LossScaler | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """forward/backward -> (fp16: unscale) -> global grad norm -> AdamW, with no host-device sync.

    Clipping and skipping are folded into the fused AdamW kernel through the hooks GradScaler
    uses: it divides the gradients by `grad_scale` (max(1, norm / grad_clip): clipping without a
    separate pass over the gradients) and skips the update where `found_inf` is set (a non-finite
    norm). Returns tensors: (this rank's part of the global mean loss, global grad norm, 1.0 if the
    update was skipped). `n_targets`: targets in the global batch (see `loss_scale`). `scaler`:
    fp16's dynamic loss scale (train/loss_scale.py): a step that overflows is skipped like any
    non-finite one and lowers the scale. `positions`: each token's position within its document
    (document masking, model/masks.py), None for plain causal attention. Gradients are cleared at
    the start, so they can be inspected after the step."""
    micro_batch = layout.micro_batch_size * model.rows_per_sample
    clear_gradients(model, optimizer, stable=t.cuda_graphs and len(inputs) > micro_batch)
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    positions = None if positions is None else to_device(positions, device)
    with context():
        scale = loss_scale(targets, n_targets, layout)
        loss = forward_backward(model, inputs, targets, micro_batch, device, scale, scaler, positions)
    phase("optimizer")
    if scaler is not None:
        scaler.unscale(optimizer)
    grad_norm = global_grad_norm(model.distinct_parameters(), pp_group)
    skipped = (~torch.isfinite(grad_norm)).float()
    adamw = local_optimizer(optimizer)
    adamw.found_inf = skipped
    if t.grad_clip > 0:
        adamw.grad_scale = torch.clamp((grad_norm + 1e-6) / t.grad_clip, min=1.0)
    optimizer.step()
    precompute_scales(model.parts, t.fp8, model.fsdp)
    if scaler is not None:
        scaler.update(optimizer, skipped)
    return loss, grad_norm, skipped


def pipeline_loss(
    model: ParallelModel,
    inputs,
    targets,
    device,
    train: bool,
    scale: float,
    scaler: LossScaler | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the schedule (its loss_fn scaled by `scale`, and by fp16's loss scale in training; gradients
    summed over micro-batches); the summed micro-batch losses on the rank with the last stage, else 0.
    `positions` go to every stage as a keyword (the schedule splits them into micro-batches as it
    splits the inputs): every stage's attention needs the documents."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble  # (loaded with pipelines only)

    model.loss_fn.scale = scale
    model.loss_fn.scaler = scaler if train else None
    losses = [] if model.has_last_stage else None
    target = targets if model.has_last_stage else None
    args = (inputs,) if model.has_first_stage else ()
    kwargs = {} if positions is None else {"positions": positions}
    # return_outputs=False: otherwise the last stage keeps every micro-batch's logits until the step
    # ends, to return them merged (m x tokens x vocabulary; 2 GB a micro-batch for Llama 3 8B at 8k)
    if train:
        model.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    elif isinstance(model.schedule, ScheduleZBVZeroBubble):
        # ZBV's eval() fails in torch 2.13 ("stage doesn't have backward"): run a training step and
        # throw its gradients away (validation batches are few).
        with torch.enable_grad():
            model.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        for part in model.parts:
            part.zero_grad(set_to_none=True)
    else:
        model.schedule.eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    if not losses:
        return torch.zeros((), device=device)
    total = torch.stack([local_value(loss.detach()).float() for loss in losses]).sum()
    return total / model.loss_fn.scaler.factor() if model.loss_fn.scaler is not None else total


def mean_over(value: torch.Tensor, group) -> float:
    """The mean of a scalar over a process group (every member must call this)."""
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value.item()


def reduce_loss(loss: torch.Tensor, dims: ParallelDims) -> float:
    """The global mean loss: from the last pipeline stage (sum over pp), averaged over DP x CP."""
    if dims.layout.pp > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=dims.mesh("pp").get_group())
    return mean_over(loss, dims.dp_group)


@torch.no_grad()
def evaluate(model: ParallelModel, batches, device: torch.device, dims: ParallelDims, context) -> float:
    """The validation loss: each global batch's mean over its targets, averaged over `batches`
    ((inputs, targets, positions or None, targets in the global batch) of this DP rank)."""
    for part in model.parts:
        part.eval()
    total = torch.zeros((), device=device)
    for inputs, targets, positions, n_targets in batches:
        scale = loss_scale(targets, n_targets, dims.layout)
        inputs, targets = to_device(inputs, device), to_device(targets, device)
        positions = None if positions is None else to_device(positions, device)
        with context():
            if model.schedule is not None:
                total += pipeline_loss(model, inputs, targets, device, train=False, scale=scale, positions=positions)
                continue
            micro_batch = dims.layout.micro_batch_size * model.rows_per_sample
            chunks = zip(inputs.split(micro_batch), targets.split(micro_batch), split_positions(positions, micro_batch))
            for x, y, p in chunks:
                total += local_value(micro_batch_loss(model, model.parts[0], x, y, p)) * scale
    for part in model.parts:
        part.train()
    return reduce_loss(total / len(batches), dims)
