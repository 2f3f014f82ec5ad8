"""Layouts, composed the way torchtitan does: one small function per technique, applied in order
LoRA adapters -> FP8 linears -> bf16 arithmetic choice -> TP -> EP -> CP -> activation checkpointing ->
compile -> FSDP (on meta) -> materialise -> DDP; pipeline stages first."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.model.args import LoraSpec
from meshtrain.model.llama import Attention
from meshtrain.model.lora import apply_lora, freeze_base
from meshtrain.parallel.activation_checkpoint import apply_ac
from meshtrain.parallel.compile import apply_compile
from meshtrain.parallel.context_parallel import apply_cp, shard_targets
from meshtrain.parallel.data_parallel import apply_ddp
from meshtrain.parallel.float8 import apply_fp8
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.parallel.pipeline import ScaledLoss, build_schedule, pipeline_stage_modules, tied_output
from meshtrain.parallel.precision import apply_fp32_compute, arithmetic_label, fp32_classes

__all__ = [
    "ParallelDims",
    "ParallelModel",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "apply_ddp",
    "apply_fp8",
    "apply_fp32_compute",
    "arithmetic_label",
    "fp32_classes",
    "parallelize",
]


@dataclass
class ParallelModel:
    """This rank's share of the model: one part, or one per pipeline stage it holds."""

    parts: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    schedule: object | None  # a torch.distributed.pipelining schedule when pp > 1
    fsdp: bool  # parameters are FSDP shards (mixed precision handled by FSDP, not autocast)
    loss_fn: Callable  # (logits, targets) -> summed loss of the targets; compiled with training.compile
    loss_parallel: bool = False  # TP's vocabulary-sharded logits: the loss runs under loss_parallel()
    grad_average_group: object | None = None  # pipeline stages with plain DP: average after backward
    tied_group: object | None = None  # tied embeddings over a pipeline: the first and last stage's ranks
    ties_across_stages: bool = False  # the first stage's embedding and the last's output are copies
    preference: Callable | None = None  # DPO (train/preference.py): replaces loss_fn, with a reference pass
    reference: list[nn.Module] | None = None  # DPO without adapters: the frozen copy of the base
    expert_params: list[torch.Tensor] = dataclasses.field(default_factory=list)  # split by EP: not DDP's nor FSDP's
    expert_replica_group: object | None = None  # EP: the ranks holding the same experts (their gradients sum)
    dp_cp: int = 1  # the ranks each loss is a share of: what the experts' summed gradients are divided by

    @property
    def rows_per_sample(self) -> int:
        """Sequences a sample of the batch is: a preference pair is two."""
        return 2 if self.preference is not None else 1

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def parameters(self) -> list[torch.Tensor]:
        return [p for part in self.parts for p in part.parameters()]

    def distinct_parameters(self) -> list[torch.Tensor]:
        """The parameters without a tied embedding's copy on the last stage: what the gradient norm
        counts, so that the matrix counts once, as on one process."""
        if not self.ties_across_stages:
            return self.parameters()
        copies = {id(part.output.weight) for part in self.parts if tied_output(part)}
        return [p for p in self.parameters() if id(p) not in copies]


def apply_ep(part: nn.Module, ep_mesh) -> list[torch.Tensor]:
    from meshtrain.parallel.expert_parallel import apply_ep  # (loads DTensor: dtensor.py)

    return apply_ep(part, ep_mesh)


def _fully_shard(part: nn.Module, dims: ParallelDims, half, experts: list[torch.Tensor]) -> list[torch.Tensor]:
    """ZeRO-2/3 of a part; returns the expert-parallel experts it leaves to EP's own reduction (those no
    other rank holds: where others do, FSDP shards them over those ranks and reduces them)."""
    from meshtrain.parallel.fully_shard import apply_fsdp

    layout, replicas = dims.layout, dims.mesh("ep_replicas")
    sharded = (replicas, layout.dp_cp) if replicas is not None else None
    apply_fsdp(part, dims.fsdp_mesh(), layout.zero, half, layout.cpu_offload, set(experts), sharded)
    return [] if sharded is not None else experts


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    training,
    device: torch.device,
    loss_fn: Callable,
    materialize: contextlib.AbstractContextManager | None = None,
    lora: LoraSpec | None = None,
    frozen: bool = False,
) -> ParallelModel:
    """`model` is built on the meta device; returns materialised, initialised parts. Who holds and
    computes what comes from the layout (`dims.layout`) alone; from `training` only the arithmetic
    (dtype, bf16_compute, compile; "auto" resolved by job/arithmetic.py) and the seed of the
    weights. `materialize`: the context the parameters are allocated and initialised in (a dry run's
    FakeTensorMode, which allocates nothing). `lora`: adapters on a frozen base (its storage bf16
    under bf16/fp16 training). `frozen`: nothing trains (DPO's reference model): no DDP, bf16/fp16
    storage under bf16/fp16 training."""
    layout = dims.layout
    if training.compile and layout.tp == 1:  # loss_parallel's DTensor logits stay eager
        loss_fn = torch.compile(loss_fn)
    loss_fn = shard_targets(loss_fn, dims.mesh("cp"))
    if layout.pp > 1:
        loss_fn = ScaledLoss(loss_fn)
        staged = pipeline_stage_modules(model, layout, dims.rank_in("pp"))
    else:
        staged = [(0, model)]
    parts, expert_params = [], []
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training.dtype)  # mixed precision's compute dtype
    for _, part in staged:
        frozen_dtype = half
        if lora is not None:
            apply_lora(part, lora, frozen_dtype)
        elif frozen:
            freeze_base(part, frozen_dtype)
        if training.fp8 != "off":
            apply_fp8(part, training.fp8, emulate=device.type != "cuda", fp8_all_gather=layout.fsdp)
        fp32_gemm, fp32_attention = fp32_classes(training)
        if fp32_gemm or fp32_attention:
            apply_fp32_compute(part, fp32_gemm, fp32_attention)
        if training.attention_backward == "recompute":  # CPU: model/recompute_attention.py
            for module in part.modules():
                if isinstance(module, Attention):
                    module.recompute_backward = True
        if layout.tp > 1:
            from meshtrain.parallel.tensor_parallel import apply_tp  # (these two load DTensor: dtensor.py)

            apply_tp(part, dims.mesh("tp"), layout.sequence_parallel, layout.loss_parallel)
            if lora is not None or frozen:
                freeze_base(part)
        split = apply_ep(part, dims.mesh("ep")) if layout.ep > 1 else []  # experts of this rank's own
        if layout.cp > 1:
            apply_cp(part, dims.mesh("cp"))
        apply_ac(part, layout.activation_checkpointing, layout.ac_every, random=bool(lora and lora.dropout))
        if training.compile:
            whole_model = layout.dp_cp == 1 and layout.pp == 1
            apply_compile(part, whole_model, exact_casts=fp32_gemm, cuda_graphs=training.cuda_graphs)
        if layout.fsdp:
            split = _fully_shard(part, dims, half, split)
        with materialize or contextlib.nullcontext():
            part.to_empty(device=device)
            part.init_weights(training.seed, buffer_device=device, draw=materialize is None)
        if layout.ddp and not frozen:
            part = apply_ddp(part, dims.mesh("dp_cp"), set(split))
        parts.append(part)
        expert_params += split
    stage_ids = [idx for idx, _ in staged]
    schedule, tied_group = None, None
    ties = layout.pp > 1 and model.args.tie_embeddings
    last_pp = next(r for r in range(layout.pp) if layout.holds_last_stage(r)) if ties else 0
    if ties and last_pp != 0 and materialize is None:
        tied_group = dims.pair_group(0, last_pp)
    if layout.pp > 1:
        schedule = build_schedule(
            list(zip(stage_ids, parts)),
            layout.n_stages,
            dims.mesh("pp"),
            device,
            layout.pp_schedule,
            layout.micro_batches,
            loss_fn,
        )
    return ParallelModel(
        parts,
        stage_ids,
        layout.n_stages,
        schedule,
        layout.fsdp,
        loss_fn,
        layout.tp > 1 and layout.loss_parallel,
        dims.dp_group if layout.averages_after_backward else None,
        tied_group,
        ties,
        expert_params=expert_params,
        dp_cp=layout.dp_cp,
        expert_replica_group=dims.mesh("ep_replicas").get_group() if dims.mesh("ep_replicas") else None,
    )
