"""One typed config tree: TOML file -> dataclasses, dotted CLI overrides, validation.

Every check here runs before any process group starts, and every failure names the key, the value
and what is allowed, as one line (`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from meshtrain.errors import ConfigError
from meshtrain.model.llama import ModelArgs
from meshtrain.model.presets import PRESETS


@dataclass
class ModelConfig:
    preset: str = "tiny"
    # Each of these overrides the preset's value when set.
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None  # unset: the prepared data's vocabulary
    max_seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    # Pad the embedding/output rows to a multiple of this (Megatron's make-vocab-size-divisible-by);
    # must be a multiple of parallel.tp. The padding is recorded and stripped on export.
    vocab_multiple: int | None = None
    # "hf:DIR": start from a local Hugging Face Llama directory (its config.json replaces the preset)
    init_from: str = ""


@dataclass
class DataConfig:
    path: str = "data/stdlib"  # a directory written by `meshtrain data prepare`
    # When `path` holds no prepared data yet, build it from this corpus: "stdlib" (the Python
    # standard library's own source, present on every machine) or "" (never build; error instead).
    corpus: Literal["stdlib", ""] = "stdlib"
    vocab_size: int = 8192  # BPE vocabulary trained for `corpus`


@dataclass
class TrainingConfig:
    steps: int = 100
    global_batch_size: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr x this
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    seed: int = 0
    dtype: Literal["fp32", "bf16"] = "fp32"
    # With dtype bf16, the arithmetic of matmuls and attention: "bf16" kernels, or "fp32" on
    # bf16-rounded inputs (same storage and numbers; faster on CPUs without AMX, see
    # parallel/precision.py); "auto": fp32 on an x86 CPU without AMX, bf16 on GPUs and elsewhere.
    bf16_compute: Literal["auto", "bf16", "fp32"] = "auto"
    # Recompute activations in backward: "full" every block, "selective" every ac_every-th block.
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every: int = 2
    # torch.compile each transformer block (and the loss): fused norms, RoPE, SwiGLU and casts.
    # The first step pays the compile time (tens of seconds; cached in /tmp/torchinductor_$USER).
    compile: bool = False
    eval_every: int = 50  # steps between validation passes; 0 = only at the end
    eval_batches: int = 4  # global batches of validation data per pass
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = look up the GPU or measure the CPU
    # Planned stops, so a long schedule runs as a chain of jobs (both checkpoint, then exit 0):
    stop_at_step: int = 0  # stop after this step of the `steps`-long schedule (0: run to the end)
    time_limit: str = ""  # wall-clock budget, "HH:MM:SS" or seconds (Slurm --time, ABCI h_rt)
    on_nonfinite: Literal["skip", "stop"] = "skip"  # a NaN/Inf loss or gradient norm: skip the step, or stop


@dataclass
class ParallelConfig:
    """The layout. DP = world / (tp x pp); the shard degree is DP / dp_replicate."""

    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1  # > 1 with zero 2/3: hybrid sharding (shard within, replicate across)
    # 0: DDP; 1: + optimizer states sharded (ZeroRedundancyOptimizer); 2: + gradients sharded
    # (FSDP2, parameters kept between forward and backward); 3: + parameters sharded (FSDP2).
    zero: int = 0
    sequence_parallel: bool = True  # with tp > 1: norms and residuals sharded along the sequence
    loss_parallel: bool = True  # with tp > 1: cross-entropy on vocabulary-sharded logits
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"] = "1f1b"
    pp_microbatches: int = 0  # 0: derived, local batch / training.micro_batch_size
    pp_virtual_stages: int = 1  # pipeline stages per rank (interleaved schedules need >= 2)


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0: none, except on preemption and planned stops)
    keep: int = 3  # committed checkpoints kept; older ones are deleted after a newer one commits
    async_: bool = False  # TOML key `async`: DCP async save, training continues while it writes
    resume: str = "auto"  # "auto": latest committed checkpoint in dir, if any; "none"; or a path
    dir: str = ""  # default: <run.dir>/checkpoints


# TOML keys that are Python keywords.
ALIASES = {"async": "async_"}


@dataclass
class LaunchConfig:
    # "auto" detects torchrun, Slurm, Open MPI, MPICH, AzureML (see docs/launching.md); or force one
    env: Literal["auto", "torchrun", "azureml", "openmpi", "mpich", "slurm", "single"] = "auto"


@dataclass
class RunConfig:
    dir: str = "runs/tiny"
    log_every: int = 10
    progress: bool = True  # rich progress bar on rank 0 (only drawn on a terminal)
    tensorboard: bool = True
    save_model: bool = True  # write the trained weights to <dir>/model.safetensors at the end
    sample_prompt: str = "def "  # after training, rank 0 prints a continuation; "" to skip
    sample_tokens: int = 48


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def model_args(self, vocab_size: int | None = None) -> ModelArgs:
        """The preset (or the model.init_from config) with this config's overrides applied;
        `vocab_size` fills an unset one."""
        if self.model.init_from:
            from meshtrain.interop.hf import hf_model_args

            args = hf_model_args(self.model.init_from.removeprefix("hf:"))
            vocab_size = None  # the checkpoint's embedding decides
        else:
            args = dataclasses.replace(PRESETS[self.model.preset])
        for f in dataclasses.fields(ModelArgs):
            value = getattr(self.model, f.name, None)
            if value is not None:
                setattr(args, f.name, value)
        if self.model.vocab_size is None and vocab_size is not None:
            args.vocab_size = vocab_size
        return args


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or start from defaults), apply `--section.key value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (the shipped ones are in configs/)")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    cfg = _build(Config, raw, "")
    for key, value in parse_overrides(overrides or []):
        set_dotted(cfg, key, value)
    validate(cfg)
    return cfg


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """`--training.steps 50` or `--training.steps=50` -> [("training.steps", "50")]."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg} needs a value: {arg} VALUE")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def set_dotted(cfg: Config, key: str, text: str) -> None:
    section_name, _, name = key.partition(".")
    name = ALIASES.get(name, name)
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section) or "." in name:
        raise ConfigError(f"unknown config key {key!r}: sections are {', '.join(_field_names(cfg))}")
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        raise ConfigError(
            f"unknown config key {key!r}: keys of [{section_name}] are {', '.join(_field_names(section))}"
        )
    setattr(section, name, _from_text(text, hints[name], key))


def _field_names(obj: Any) -> list[str]:
    inverse = {v: k for k, v in ALIASES.items()}
    return [inverse.get(f.name, f.name) for f in dataclasses.fields(obj)]


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for toml_key, value in raw.items():
        key = ALIASES.get(toml_key, toml_key)
        dotted = f"{prefix}{toml_key}"
        if key not in hints:
            where = f"[{prefix[:-1]}]" if prefix else "the top level"
            raise ConfigError(
                f"unknown config key {dotted!r}: keys of {where} are {', '.join(_field_names(cls))}"
            )
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted!r} must be a table [{dotted}]")
            kwargs[key] = _build(hint, value, f"{dotted}.")
        else:
            kwargs[key] = _check_type(value, hint, dotted)
    return cls(**kwargs)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint) if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check_type(value, args[0], key)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key} = {value!r} is not allowed: use {_describe(hint)}")
        return value
    ok = (
        (hint is bool and isinstance(value, bool))
        or (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (hint is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{key} = {value!r} has the wrong type: it must be {_describe(hint)}")
    return float(value) if hint is float else value


def _from_text(text: str, hint: Any, key: str) -> Any:
    """Parse a command-line string by the field's type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null"):
            return None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _from_text(text, args[0], key)
    if origin is Literal or hint is str:
        return _check_type(text, hint, key)
    try:
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        return hint(text)
    except ValueError:
        raise ConfigError(f"--{key} {text!r} has the wrong type: it must be {_describe(hint)}") from None


# ---------------------------------------------------------------------------------------------
# Validation


def _positive(value: int | float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key} = {value} must be positive")


def validate(cfg: Config, world_size: int | None = None, data_vocab_size: int | None = None) -> None:
    """Checks that need no process group. `world_size` adds the layout checks; the data's
    vocabulary adds the embedding check."""
    m, t, r = cfg.model, cfg.training, cfg.run
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset = {m.preset!r} is unknown: use one of {', '.join(PRESETS)}")
    if m.init_from and not (m.init_from.startswith("hf:") and Path(m.init_from[3:], "config.json").is_file()):
        raise ConfigError(f"model.init_from = {m.init_from!r}: use \"hf:DIR\" with a local Hugging Face Llama "
                          "directory (config.json + safetensors)")
    for key in ("steps", "global_batch_size", "micro_batch_size", "seq_len", "lr", "eval_batches"):
        _positive(getattr(t, key), f"training.{key}")
    _positive(r.log_every, "run.log_every")
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
                "rope_theta", "norm_eps", "vocab_multiple"):
        if getattr(m, key) is not None:
            _positive(getattr(m, key), f"model.{key}")
    if t.warmup_steps < 0 or t.eval_every < 0 or t.grad_clip < 0 or t.weight_decay < 0:
        raise ConfigError("training.warmup_steps, eval_every, grad_clip and weight_decay must be >= 0")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"training.min_lr_ratio = {t.min_lr_ratio} must be between 0 and 1")

    args = cfg.model_args()
    if args.dim % args.n_heads:
        raise ConfigError(f"model.dim ({args.dim}) must be divisible by model.n_heads ({args.n_heads})")
    if args.head_dim % 2:
        raise ConfigError(f"head dimension model.dim / model.n_heads = {args.head_dim} must be even for rotary embeddings")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(
            f"model.n_heads ({args.n_heads}) must be a multiple of model.n_kv_heads ({args.n_kv_heads})"
        )
    if t.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len ({t.seq_len}) is longer than the model allows "
            f"(model.max_seq_len = {args.max_seq_len}); lower it or raise model.max_seq_len"
        )
    if data_vocab_size is not None and (m.vocab_size is not None or m.init_from) and args.vocab_size < data_vocab_size:
        raise ConfigError(
            f"the model's vocabulary ({args.vocab_size}) is smaller than the data's ({data_vocab_size}); "
            "leave model.vocab_size unset to use the data's, or use data tokenized for model.init_from"
        )
    _positive(t.ac_every, "training.ac_every")
    if t.stop_at_step < 0 or t.stop_at_step > t.steps:
        raise ConfigError(f"training.stop_at_step = {t.stop_at_step} must be between 0 and training.steps ({t.steps})")
    parse_duration(t.time_limit, "training.time_limit")
    c = cfg.checkpoint
    if c.every < 0 or c.keep < 1:
        raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(f"checkpoint.resume = {c.resume!r}: no such checkpoint (use auto, none or a path)")
    if world_size is not None:
        from meshtrain.parallel.mesh import ParallelDims

        dims = ParallelDims.from_config(cfg.parallel, world_size)
        dims.validate_model(args, cfg.parallel, t.activation_checkpointing)
        if t.compile and dims.tp > 1 and dims.dp > 1:
            raise ConfigError(
                f"training.compile = true with parallel.tp = {dims.tp} and FSDP over {dims.dp} data-parallel ranks "
                "fails in torch 2.13 (FSDP hooks inside the whole-model graph that TP needs); compile TP alone or "
                "TP x PP, or run TP x FSDP eagerly"
            )
        per_step = t.micro_batch_size * dims.dp
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"training.micro_batch_size ({t.micro_batch_size}) x data-parallel degree ({dims.dp}) = {per_step}"
            )
        dims.validate_schedule(cfg.parallel, t.global_batch_size // per_step)


def parse_duration(text: str, key: str) -> float:
    """"HH:MM:SS", "MM:SS", "D-HH:MM:SS" (Slurm) or seconds -> seconds; "" -> 0 (no limit)."""
    if not text:
        return 0.0
    try:
        days, _, clock = text.rpartition("-")
        parts = [float(x) for x in clock.split(":")]
        if len(parts) > 3:
            raise ValueError
        seconds = sum(v * 60**i for i, v in enumerate(reversed(parts)))
        seconds += 86400 * int(days) if days else 0
    except ValueError:
        raise ConfigError(f'{key} = "{text}" is not a duration: use "HH:MM:SS" or seconds') from None
    if seconds <= 0:
        raise ConfigError(f"{key} = {text!r} must be positive")
    return seconds


def grad_accum_steps(cfg: Config, dp: int) -> int:
    """Micro-batches per step on one rank (under PP: the schedule's number of micro-batches)."""
    return cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)


def to_toml(cfg: Config) -> str:
    inverse = {v: k for k, v in ALIASES.items()}

    def drop_none(d: dict) -> dict:
        return {inverse.get(k, k): drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

    return tomli_w.dumps(drop_none(dataclasses.asdict(cfg)))


def write_resolved(cfg: Config, run_dir: Path, args: ModelArgs) -> None:
    """Write the config as it was used, with the model's shape spelled out."""
    resolved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    for f in dataclasses.fields(ModelArgs):
        setattr(resolved.model, f.name, getattr(args, f.name))
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(to_toml(resolved))
    tmp.replace(run_dir / "config.toml")
