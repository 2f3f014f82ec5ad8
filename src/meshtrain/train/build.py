"""Everything a training step needs, built once: who am I -> data -> the Job resolved (job/) ->
its arithmetic on this device ("auto" resolved) -> model on the mesh -> optimizer.

`build(cfg)` is what the loop, the tests and the benchmarks use, so all three train the same thing;
the dry run builds the same `build_model` on a fake process group and fake tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.checkpoint.checkpointer import Checkpointer
from meshtrain.config import Config
from meshtrain.data import Blend, DistributedLoader, validation_batches
from meshtrain.errors import DataError
from meshtrain.hardware import keep_freed_memory
from meshtrain.job import Job, resolve
from meshtrain.job.data import ensure_dataset
from meshtrain.job.device import check_device
from meshtrain.launch import LaunchEnv, detect
from meshtrain.launch.distributed import init_distributed
from meshtrain.layout import Layout
from meshtrain.logs import log
from meshtrain.model import Llama, ModelArgs, num_params
from meshtrain.model.args import LoraSpec
from meshtrain.model.moe import clear_counters, end_step, set_aux_weight
from meshtrain.optim import build_optimizer
from meshtrain.parallel import ParallelDims, ParallelModel, parallelize
from meshtrain.train.loss_scale import LossScaler
from meshtrain.train.plan_check import warn_if_too_big
from meshtrain.train.preference import DEFAULT_BETA, PreferenceLoss
from meshtrain.train.step import cross_entropy, pipeline_loss, step_context, to_device, train_step
from meshtrain.train.watchdog import checkpoint_group_timeout, enable_flight_recorder, process_group_timeout


def verify_data(dataset: Blend, rank: int, world: int) -> None:
    """Every shard's checksum, each rank reading its share; a damaged shard stops every rank with
    the same line."""
    problems = [p for source in dataset.sources for p in source.verify((rank, world))]
    if dist.is_initialized():
        everyone: list = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = [p for ps in everyone for p in ps]
    if problems:
        raise DataError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


@dataclass
class TrainState:
    """This rank's share of a training run: the Job it runs (resolved on this rank's device) and
    what was built for it."""

    job: Job
    env: LaunchEnv
    dims: ParallelDims
    n_params: int
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DistributedLoader | None = None
    val: dict[str, list] = field(default_factory=dict)  # validation batches of each source
    checkpointer: Checkpointer | None = None
    scaler: LossScaler | None = None  # fp16's dynamic loss scale
    pipeline_shapes_known: bool = False  # the stages have run their metadata inference (MoE: see step)

    def __post_init__(self):
        if self.cfg.training.dtype == "fp16" and self.scaler is None:
            self.scaler = LossScaler(self.cfg.training, self.device, self.model.fsdp)

    @property
    def cfg(self) -> Config:
        """The job's config, its "auto" arithmetic resolved."""
        return self.job.cfg

    @property
    def args(self) -> ModelArgs:
        return self.job.args

    @property
    def device(self) -> torch.device:
        return self.job.device

    @property
    def dataset(self) -> Blend | None:
        return self.job.dataset

    @property
    def lora(self) -> LoraSpec | None:
        return self.job.lora

    @cached_property
    def base(self) -> dict:
        """The model this run started from (interop/base.base_identity: its directory, config and weights'
        fingerprint), read once: every save records it."""
        from meshtrain.interop.base import base_identity

        return base_identity(self.cfg)

    @property
    def layout(self) -> Layout:
        return self.dims.layout

    @property
    def pp_group(self):
        return self.dims.mesh("pp").get_group() if self.layout.pp > 1 else None

    def context(self):
        return step_context(self.model, self.cfg.training, self.device)

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        n_targets: int | None = None,
        positions: torch.Tensor | None = None,
    ):
        """One optimizer step (see train.step.train_step); the LR schedule is stepped by the caller.
        `n_targets`: targets in the global batch (None: every token of every rank's batch);
        `positions`: each token's within its document (document masking; None: plain causal).
        An MoE model's aux loss weighs each of this rank's micro-batches equally (and is scaled as
        fp16 scales the loss); after the step the aux-loss-free bias moves (model/moe.py)."""
        if self.moe and self.layout.pp > 1 and not self.pipeline_shapes_known:
            self.infer_pipeline_shapes(inputs, targets, positions)
        if self.moe:
            micro_batches = -(-len(inputs) // (self.layout.micro_batch_size * self.model.rows_per_sample))
            scale = self.scaler.factor() if self.scaler is not None else torch.ones((), device=self.device)
            set_aux_weight(self.model.parts, scale / micro_batches)
        result = train_step(
            self.model,
            self.optimizer,
            inputs,
            targets,
            self.layout,
            self.cfg.training,
            self.device,
            self.context,
            self.pp_group,
            n_targets,
            self.scaler,
            positions,
        )
        if self.moe:
            end_step(self.model.parts, self.balance_groups)
        return result

    def infer_pipeline_shapes(self, inputs, targets, positions) -> None:
        """torch's pipeline stages learn their shapes in their first step by running its first
        micro-batch forward and backward once more (later stages on empty tensors), which MoE layers
        would count as routed tokens. So that runs here, on a batch of zeros weighing nothing, and
        the counters and gradients it leaves are cleared."""
        set_aux_weight(self.model.parts, torch.zeros((), device=self.device))
        zeros = [torch.zeros_like(to_device(t, self.device)) for t in (inputs, targets)]
        positions = None if positions is None else to_device(positions, self.device)
        with self.context():
            pipeline_loss(self.model, *zeros, self.device, train=True, scale=0.0, positions=positions)
        for part in self.model.parts:
            part.zero_grad(set_to_none=True)
        clear_counters(self.model.parts)
        self.pipeline_shapes_known = True

    @property
    def moe(self) -> bool:
        return self.args.n_experts > 0

    @property
    def balance_groups(self) -> list:
        """Where an MoE layer's expert counts are summed: the data-parallel ranks, then the stages."""
        return [self.dims.dp_group, self.pp_group]


def build_model(
    job: Job, materialize: contextlib.AbstractContextManager | None = None
) -> tuple[ParallelDims, ParallelModel, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, int]:
    """This rank's part of the job, on the process group that is up and the job's device: the
    DeviceMesh, the model built on the meta device with the layout applied, and the optimizer (with
    its ZeRO-1 partition). `materialize`: the context parameters and optimizer states are allocated in
    (the dry run's FakeTensorMode: shapes, no memory). Returns the mesh, the model, the optimizer, the
    LR schedule and the full model's parameter count."""
    t, device, layout = job.cfg.training, job.device, job.layout
    dims = ParallelDims(layout)
    dims.build_mesh(device.type)
    with torch.device("meta"):
        full_model = Llama(job.args)
    model = parallelize(full_model, dims, t, device, cross_entropy, materialize, job.lora)
    if t.objective == "dpo":
        model.preference = PreferenceLoss(t.dpo_beta or DEFAULT_BETA, device)
        if job.lora is None:  # the reference: a frozen copy of the base, laid out as the model
            with torch.device("meta"):
                copy = Llama(job.args)
            reference = parallelize(copy, dims, t, device, cross_entropy, materialize, frozen=True)
            model.reference = reference.parts
    with materialize or contextlib.nullcontext():
        dp_group = dims.dp_group if layout.dp_cp > 1 else None
        optimizer, scheduler = build_optimizer(model.parameters(), t, layout.zero, dp_group)
    return dims, model, optimizer, scheduler, num_params(full_model)


def build(cfg: Config, env: LaunchEnv | None = None, with_data: bool = True) -> TrainState:
    """Start the process group, read the data (rank 0 prepares it first), resolve the Job, build
    the model on the meta device and apply the layout, then the optimizer. Without data, the model's
    vocabulary is model.vocab_size (or the preset's): for tests and benchmarks that bring their own
    batches."""
    env = env or detect(launcher=cfg.launch.env)
    if cfg.launch.device != "cpu" and torch.cuda.is_available():
        enable_flight_recorder()
    t = cfg.training
    device = init_distributed(env, cfg.launch.device, process_group_timeout(t.hang_timeout, t.first_step_timeout))
    check_device(cfg, device)
    if device.type == "cpu":  # each step's activations in the pages the last one used (hardware.py)
        keep_freed_memory()
    job = resolve(cfg, env.world_size)  # what needs no data is refused before the data is read
    if with_data:
        if env.rank == 0:
            ensure_dataset(cfg)
        if dist.is_initialized():
            dist.barrier()
        dataset = Blend(cfg.data.path, cfg.training.seq_len, cfg.training.document_masking)
        verify_data(dataset, env.rank, env.world_size)
        if dataset.unmasked_text and env.rank == 0:
            log.info(
                f"training.document_masking: {', '.join(dataset.unmasked_text)} has no end-of-text token to end "
                "its documents, so its sequences train with plain causal attention"
            )
        job = resolve(cfg, env.world_size, dataset)  # the data's vocabulary, tokenizer and kind checked too
    job = job.on_device(device)
    cfg, layout, t, dataset = job.cfg, job.layout, job.cfg.training, job.dataset
    torch.manual_seed(t.seed)
    if env.rank == 0:
        warn_if_too_big(job, env.local_world_size)
    dims, model, optimizer, scheduler, n_params = build_model(job)
    state = TrainState(job, env, dims, n_params, model, optimizer, scheduler)
    if dataset is not None:
        state.loader = dataset.loader(t.global_batch_size, dims.dp_rank, layout.dp, t.seed, device.type == "cuda")
        for name, source in zip(dataset.names, dataset.sources):
            if len(source.val):  # few and fixed: copied to the device once
                batches = validation_batches(source.val, t.eval_batches, t.global_batch_size, dims.dp_rank, layout.dp)
                state.val[name] = [
                    (x.to(device), y.to(device), p if p is None else p.to(device), n) for x, y, p, n in batches
                ]
        root = Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints")
        state.checkpointer = Checkpointer(
            root,
            model.parts,
            optimizer,
            cfg.checkpoint.keep,
            cfg.checkpoint.async_,
            env.rank,
            checkpoint_group_timeout(cfg.training.hang_timeout),
        )
    return state


def warn_pointless_settings(s: TrainState) -> None:
    """Settings that are valid alone but make little sense with this data or schedule."""
    t, c = s.cfg.training, s.cfg.checkpoint
    for name, source in zip(s.dataset.names, s.dataset.sources):
        what = "preference pairs" if source.preference else "conversations"
        if source.chat and source.train.too_long:
            log.warning(
                f"{name}: {source.train.too_long} of {source.train.too_long + source.train.conversations} training "
                f"{what} are longer than training.seq_len + 1 = {t.seq_len + 1} tokens and are left out"
            )
        if name not in s.val:
            log.warning(f"{source.val.name or name} holds less than one sequence; no validation loss for it")
        elif t.eval_batches > (one_pass := -(-len(source.val) // t.global_batch_size)):
            log.warning(
                f"training.eval_batches ({t.eval_batches}): the validation split of {name} holds {one_pass} "
                f"batch(es) of {t.global_batch_size}; one pass over it is evaluated"
            )
    if t.warmup_steps > t.steps:
        log.warning(
            f"training.warmup_steps ({t.warmup_steps}) > training.steps ({t.steps}): the learning rate "
            "never reaches training.lr, and training.min_lr_ratio has no effect"
        )
    elif t.steps > 1 and t.warmup_steps >= t.steps - 1:
        log.warning(
            f"training.warmup_steps ({t.warmup_steps}) leaves no step of training.steps ({t.steps}) to decay "
            "over: training.min_lr_ratio has no effect"
        )
    for key, every, what in (
        ("checkpoint.every", c.every, "checkpointed"),
        ("training.eval_every", t.eval_every, "evaluated"),
        ("run.log_every", s.cfg.run.log_every, "logged (with the first)"),
    ):
        if every > t.steps:
            log.warning(f"{key} ({every}) > training.steps ({t.steps}): only the last step is {what}")
    for name, weight, source in zip(s.dataset.names, s.dataset.weights, s.dataset.sources):
        epochs = t.steps * t.global_batch_size * weight / len(source.train)
        if epochs > 1:
            log.warning(
                f"the schedule reads the training data of {name} {epochs:.1f} times ({len(source.train)} "
                f"{'pairs' if source.preference else 'sequences'} of {t.seq_len} tokens): expect overfitting; add "
                "data or lower training.steps"
            )
