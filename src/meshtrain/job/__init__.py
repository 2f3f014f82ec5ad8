"""A job resolved once: `resolve(cfg, world, dataset)` turns a checked Config into a frozen `Job` that
holds everything derived from it (the model's shape and its parameter facts, the layout at the job's
world size, the adapters' settings) or refuses it in one line, before any work. Every command that
builds or checks a job takes a Job from here: train's launcher and each worker (train/build.py), the
dry run, plan --verify and jobscript; nothing below reads the config for a derived fact.

The rules live beside what they check: job/model.py (the shape), job/layout.py (the degrees, the
batch, the schedule), job/refusals.py (what a layout cannot run), job/data.py (the data), job/device.py
(the device). The device's arithmetic ("auto" dtype, attention's backward) is timed where the job
trains, `Job.on_device`, and recorded in the Job with the config it resolved."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtrain.config import Config, check_keys_in_force
from meshtrain.errors import ConfigError
from meshtrain.job.layout import check_layout, layout_of
from meshtrain.job.model import adapters_of, resolve_model
from meshtrain.job.refusals import layout_refusal
from meshtrain.layout import Layout
from meshtrain.model.args import LoraSpec, ModelArgs
from meshtrain.model.shapes import Shape

if TYPE_CHECKING:  # annotations only: the launcher loads neither the data stack nor torch's devices here
    import torch

    from meshtrain.data import Blend
    from meshtrain.job.arithmetic import Choice
    from meshtrain.job.attention_backward import AttentionBackward


@dataclass(frozen=True)
class Job:
    """One job: its config and what the config resolves to at `world` ranks. `dataset`: the prepared
    data where it is here (None before the default corpus is prepared). `device`, `arithmetic` and
    `attention`: set by `on_device`, whose `cfg` then holds the resolved dtype and kernels; `given`
    keeps the config as it was given ("auto" where it said auto: what the run records)."""

    cfg: Config
    world: int
    args: ModelArgs
    shape: Shape
    layout: Layout
    lora: LoraSpec | None
    dataset: Blend | None = None
    device: torch.device | None = None
    arithmetic: Choice | None = None
    attention: AttentionBackward | None = None
    given: Config | None = None

    def on_device(self, device: torch.device, time_attention: bool = True) -> Job:
        """This job with training.dtype / bf16_compute "auto" resolved on `device` (a GPU with bf16 units
        runs bf16; a CPU times the model's own block in every arithmetic, cached) and, with
        `time_attention`, training.attention_backward (a compiled CPU run times both backwards)."""
        from meshtrain.job import arithmetic, attention_backward

        cfg, choice = arithmetic.resolve(self.cfg, self.args, device, self.layout if time_attention else None)
        attention = None
        if time_attention:
            cfg, attention = attention_backward.resolve(cfg, self.args, self.layout, device)
        given = self.given or self.cfg
        return dataclasses.replace(self, cfg=cfg, device=device, arithmetic=choice, attention=attention, given=given)


def resolve(cfg: Config, world: int, dataset: Blend | None = None) -> Job:
    """The job `cfg` describes on `world` ranks, or the one-line reason it cannot train. `dataset`:
    the prepared data (None where it is not here yet, as for the default corpus)."""
    from meshtrain.job.data import check_init_tokenizer, check_objective_data, check_sample_fits

    t = cfg.training
    check_keys_in_force(cfg)
    args, shape = resolve_model(cfg, dataset.vocab_size if dataset is not None else None)
    layout = layout_of(cfg, world)
    check_layout(layout, args, cfg)
    lora = adapters_of(cfg.peft, moe=args.n_experts > 0)
    if problem := layout_refusal(shape, layout, lora, t.objective, t.fp8, t.cuda_graphs):
        raise ConfigError(problem)
    if args.n_experts and t.compile:
        raise ConfigError(
            "training.compile with a mixture of experts: each expert's share of the tokens is data, which "
            "meshtrain's whole-block graphs cannot hold yet; train without training.compile"
        )
    if dataset is not None:
        check_init_tokenizer(cfg, dataset)
        check_objective_data(cfg, dataset)
        check_sample_fits(cfg, args, dataset)
    return Job(cfg, world, args, shape, layout, lora, dataset)


def resolve_prepared(cfg: Config, world: int, missing_ok: bool = False) -> Job:
    """The job with its data as prepared here, for the commands that prepare nothing (the dry run,
    jobscript): what needs no data is refused first, then the data as `resolve` checks it (the
    default corpus not prepared yet is no data, as train would prepare it). `missing_ok`: data that is
    not here (prepared on the cluster, or by the job itself) is no refusal either."""
    from meshtrain.errors import DataError
    from meshtrain.job.data import prepared_dataset

    job = resolve(cfg, world)
    try:
        dataset = prepared_dataset(cfg)
    except DataError:
        if missing_ok:
            return job
        raise
    return job if dataset is None else resolve(cfg, world, dataset)


def check_dry_run(job: Job, ranks: list[int]) -> None:
    """What `train --dry-run WORLD` can build of this job: the ranks asked for, and no compiled
    kernels (they read the fake tensors' memory: the process would crash)."""
    if job.cfg.training.compile:
        raise ConfigError(
            "training.compile: a dry run builds the job on fake tensors, which compiled kernels cannot run; dry-run "
            "it with training.compile = false (the eager step holds at least as much memory)"
        )
    if job.args.n_experts:
        raise ConfigError(
            f"model.n_experts = {job.args.n_experts}: a dry run builds the job on fake tensors, through which a "
            "mixture of experts cannot route (each expert's share of the tokens is data); train it on a few real "
            "ranks instead (`meshtrain train --nproc N`)"
        )
    for rank in ranks:
        if not 0 <= rank < job.world:
            raise ConfigError(f"--dry-run-rank {rank} is not a rank of a {job.world}-rank job (0 to {job.world - 1})")


__all__ = ["Job", "check_dry_run", "resolve", "resolve_prepared"]
