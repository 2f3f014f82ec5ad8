"""Checks across values, made when a config is read: values against each other and paths that must
exist. Single values are checked by their declarations (config/options.py); what needs the model's
resolved shape, the world size, the data or the device is checked where a job is resolved (job/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the schema calls these checks
    from meshtrain.config.schema import Config, TrainingConfig


def check_across_keys(cfg: Config) -> None:
    """What single declarations cannot say: values against each other and paths that must exist. Each
    value's own type, bounds and grammar were checked where it was declared."""
    t, c = cfg.training, cfg.checkpoint
    if t.stop_at_step > t.steps:
        raise ConfigError(f"training.stop_at_step = {t.stop_at_step} must be between 0 and training.steps ({t.steps})")
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(f"checkpoint.resume = {c.resume!r}: no such checkpoint (use auto, none or a path)")
    if t.dtype in ("fp32", "fp16") and t.bf16_compute != "auto":
        raise ConfigError(
            f"training.bf16_compute = {t.bf16_compute!r} sets the arithmetic of bf16 training, but training.dtype "
            f"is {t.dtype}: set training.dtype = bf16 (or auto), or leave bf16_compute = auto"
        )
    check_precision_keys(cfg)
    if t.cuda_graphs and not t.compile:
        raise ConfigError(
            "training.cuda_graphs replays the compiled model's kernels as CUDA graphs, but training.compile is false: "
            "set training.compile = true, or drop training.cuda_graphs"
        )
    if cfg.parallel.pp_microbatches and cfg.parallel.pp == 1:
        raise ConfigError(
            f"parallel.pp_microbatches = {cfg.parallel.pp_microbatches} is the pipeline schedule's micro-batch count: "
            "it needs parallel.pp > 1 (without a pipeline, training.micro_batch_size sets the accumulation)"
        )
    check_peft_keys(cfg)
    check_run_dir_apart(cfg)


# Files of a directory a run must not write into (unless it is a meshtrain run, which keeps arithmetic.json).
FOREIGN_FILES = {
    "manifest.json": "prepared data",
    "config.json": "a Hugging Face model",
    "tokenizer.json": "a tokenizer",
}


def check_run_dir_apart(cfg: Config) -> None:
    """run.dir receives the run's config, tokenizer files, checkpoints and weights: the directory of
    the model it starts from or of its data would have its own files replaced, so either is refused,
    as is any other directory of data, a model or a tokenizer that is not a meshtrain run's."""
    from meshtrain.config.grammar import parse_data_path

    run_dir = Path(cfg.run.dir).resolve()
    inputs = [("data.path", path) for path, _ in parse_data_path(cfg.data.path)] if cfg.data.path else []
    if cfg.model.init_from:
        inputs.append(("model.init_from", cfg.model.init_from.removeprefix("hf:")))
    for key, path in inputs:
        if Path(path).resolve() == run_dir:
            raise ConfigError(
                f"run.dir = {cfg.run.dir!r} is the {key} directory: the run would write its tokenizer, config and "
                "weights over that directory's own; choose another run.dir"
            )
    if (run_dir / "arithmetic.json").is_file():  # a meshtrain run's own record: its files are the run's
        return
    for name, what in FOREIGN_FILES.items():
        if (run_dir / name).is_file():
            raise ConfigError(
                f"run.dir = {cfg.run.dir!r} holds {what} ({name}), not a meshtrain run: the run would write its "
                "tokenizer, config and weights over that directory's own; choose another run.dir"
            )


def check_precision_keys(cfg: Config) -> None:
    """fp16's loss-scale keys and FP8 only where they take effect (CPU offload: job/layout.py)."""
    t = cfg.training
    for key in ("initial_loss_scale", "loss_scale_window"):
        if getattr(t, key) is not None and t.dtype != "fp16":
            raise ConfigError(
                f"training.{key} sets fp16's dynamic loss scaling, but training.dtype is {t.dtype}: "
                "set training.dtype = fp16, or drop it"
            )
    if t.fp8 != "off":
        if t.dtype == "fp16":
            raise ConfigError(
                "training.fp8 runs its FP8 GEMMs inside bf16 or fp32 training, not fp16: set training.dtype = bf16"
            )
        if t.bf16_compute in ("fp32", "bf16-attention"):
            raise ConfigError(
                f"training.bf16_compute = {t.bf16_compute!r} computes the GEMMs in fp32, but training.fp8 = "
                f"{t.fp8!r} computes them in FP8: use bf16_compute = auto, bf16 or bf16-gemm"
            )
        if cfg.peft.method != "none":
            raise ConfigError(
                f"training.fp8 trains every weight of the blocks' linears in FP8; peft.method = "
                f"{cfg.peft.method} freezes them: drop one of the two"
            )


def check_peft_keys(cfg: Config) -> None:
    """[peft] and the objective's keys only where they take effect."""
    p, t = cfg.peft, cfg.training
    if p.method == "none":
        given = [k for k in ("rank", "alpha", "dropout", "targets") if getattr(p, k) is not None]
        if given:
            raise ConfigError(f"peft.{given[0]} sets the adapters, but peft.method is none: set peft.method = lora")
    if t.dpo_beta is not None and t.objective != "dpo":
        raise ConfigError("training.dpo_beta is DPO's: set training.objective = dpo, or drop it")
    if t.objective == "dpo" and not t.document_masking:
        raise ConfigError(
            "training.document_masking = false packs documents together, but DPO data holds one conversation a "
            "row (nothing to mask): drop it"
        )
    if p.method == "qlora" and t.dtype != "bf16":
        raise ConfigError(
            f"peft.method = qlora computes in bf16 over its 4-bit base, but training.dtype is {t.dtype}: "
            "set training.dtype = bf16 (or use peft.method = lora)"
        )


# The layout keys check_keys_in_force refuses where the key they shape leaves them nothing to do,
# and that key: `meshtrain plan` refuses such a pair only where both are pinned (it searches the other).
SHAPED_BY = {
    "pp_schedule": "pp",
    "pp_virtual_stages": "pp",
    "sequence_parallel": "tp",
    "loss_parallel": "tp",
    "ac_every": "activation_checkpointing",
}


def check_keys_in_force(cfg: Config) -> None:
    """Keys that act only beside another one, refused at the start of a job where they would do
    nothing (not when the config is read: `meshtrain plan` searches those other keys, so there a
    pipeline schedule or ac_every may come before the pipeline or checkpointing it is for)."""
    p, t = cfg.parallel, cfg.training
    default = {f.name: f.default for section in (p, t) for f in dataclasses.fields(section)}
    for key in ("pp_schedule", "pp_virtual_stages"):
        if p.pp == 1 and getattr(p, key) != default[key]:
            raise ConfigError(
                f"parallel.{key} = {getattr(p, key)!r} shapes the pipeline, but parallel.pp is 1: set parallel.pp > 1, "
                "or drop it"
            )
    for key in ("sequence_parallel", "loss_parallel"):
        if p.tp == 1 and getattr(p, key) != default[key]:
            raise ConfigError(
                f"parallel.{key} = {str(getattr(p, key)).lower()} shapes tensor parallelism, but parallel.tp is 1: "
                "set parallel.tp > 1, or drop it"
            )
    if t.activation_checkpointing != "selective" and t.ac_every != default["ac_every"]:
        raise ConfigError(
            f"training.ac_every = {t.ac_every} picks the blocks selective checkpointing recomputes, but training."
            f"activation_checkpointing is {t.activation_checkpointing!r}: set it to selective, or drop ac_every"
        )
    if t.first_step_timeout is not None and not t.hang_timeout:
        raise ConfigError(
            f"training.first_step_timeout = {t.first_step_timeout:g} is the watchdog's budget for the first step, "
            "but training.hang_timeout = 0 turns the watchdog off: set training.hang_timeout, or drop it"
        )
    r = cfg.run
    run_default = {f.name: f.default for f in dataclasses.fields(r)}
    if not r.sample_prompt and r.sample_tokens != run_default["sample_tokens"]:
        raise ConfigError(
            f"run.sample_tokens = {r.sample_tokens} sets the length of the final sample, but run.sample_prompt is "
            "empty (no sample): give a run.sample_prompt, or drop run.sample_tokens"
        )
    if not (r.save_model or r.sample_prompt) and r.save_model_max_gb != run_default["save_model_max_gb"]:
        raise ConfigError(
            f"run.save_model_max_gb = {r.save_model_max_gb} bounds the model gathered at the end to be saved or "
            "sampled, but run.save_model is false and run.sample_prompt is empty: turn either on, or drop it"
        )
    quiet = r.log_level in ("warning", "error")
    shown_at_info = [
        key for key in ("sample_prompt", "sample_tokens") if r.sample_prompt and getattr(r, key) != run_default[key]
    ]
    if quiet and (r.plan_check or shown_at_info):
        key = "plan_check" if r.plan_check else shown_at_info[0]
        raise ConfigError(
            f"run.{key} is printed at the info level, but run.log_level = {r.log_level!r} hides it: set "
            "run.log_level = info, or drop it"
        )
    if cfg.checkpoint.async_ and not cfg.checkpoint.every:
        raise ConfigError(
            "checkpoint.async overlaps the periodic checkpoints with training, but checkpoint.every is 0 (the saves "
            "at a stop or preemption always block): set checkpoint.every, or drop checkpoint.async"
        )


def check_steps_ahead(start_step: int, t: TrainingConfig) -> None:
    """A resumed run with nothing left to do would exit 0 without a word: refused instead, unless it
    is the finished run itself (its end, weights and sample, comes again)."""
    done = start_step > t.steps or (t.stop_at_step and t.stop_at_step <= start_step != t.steps)
    if done:
        key, end = ("steps", t.steps) if start_step > t.steps else ("stop_at_step", t.stop_at_step)
        raise ConfigError(
            f"the checkpoint is at step {start_step}, but training.{key} = {end}: raise training.{key} "
            "to train on, or start a new run (checkpoint.resume = none in a new run.dir)"
        )
