"""One typed config tree: TOML file -> dataclasses, dotted CLI overrides, value checks.

Each field's docstring is its `meshtrain train --help` text. Every failure names the key, the value
and what is allowed, as one line (`ConfigError`). This module is a leaf: checks that need the
model's resolved shape or the world size live with the model (`check_model_args`, below, on plain
values) and the layout (`parallel.mesh.ParallelDims.validate`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
import textwrap
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

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank; the others hold several
LAUNCHERS = ("auto", "torchrun", "azureml", "openmpi", "mpich", "slurm", "single")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Named shape: tiny, small, gpt2-124m, gpt2-345m, llama3-8b, llama3-70b, llama3-405b."""
    dim: int | None = None
    """Hidden size (unset: the preset's)."""
    n_layers: int | None = None
    """Transformer blocks (unset: the preset's)."""
    n_heads: int | None = None
    """Attention heads (unset: the preset's)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (unset: the preset's)."""
    ffn_dim: int | None = None
    """SwiGLU hidden size (unset: the preset's)."""
    vocab_size: int | None = None
    """Vocabulary (unset: the prepared data's)."""
    max_seq_len: int | None = None
    """Longest sequence the rotary tables cover (unset: the preset's)."""
    rope_theta: float | None = None
    """Rotary base (unset: the preset's)."""
    norm_eps: float | None = None
    """RMSNorm epsilon (unset: the preset's)."""
    tie_embeddings: bool | None = None
    """Share the embedding and output matrices (unset: the preset's)."""
    vocab_multiple: int | None = None
    """Pad embedding/output rows to a multiple of this (Megatron's make-vocab-size-divisible-by); a
    multiple of parallel.tp; stripped on export."""
    init_from: str = ""
    """"hf:DIR": start from a local Hugging Face Llama directory (its config.json replaces the preset)."""


@dataclass
class DataConfig:
    path: str = "data/stdlib"
    """A directory written by `meshtrain data prepare`."""
    corpus: Literal["stdlib", ""] = "stdlib"
    """When `path` holds no prepared data: "stdlib" builds it from the Python standard library's source
    (on every machine); "" never builds (an error instead)."""
    vocab_size: int = 8192
    """BPE vocabulary trained for `corpus`."""


@dataclass
class TrainingConfig:
    steps: int = 100
    """Optimizer steps of the schedule."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank (gradient accumulation or pipeline micro-batches)."""
    seq_len: int = 256
    """Tokens per sequence."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr x this."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not on norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    seed: int = 0
    """Seed of the weights and the data order."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Training precision: fp32, or bf16 mixed precision (fp32 master weights and optimizer states)."""
    bf16_compute: Literal["auto", "bf16", "fp32"] = "auto"
    """With dtype bf16, the arithmetic of matmuls and attention: "bf16" kernels, or "fp32" on bf16-rounded
    inputs (same storage and numbers; faster where bf16 kernels are slow); "auto": fp32 on an x86 CPU without
    AMX, bf16 elsewhere."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: "full" every block, "selective" every ac_every-th block."""
    ac_every: int = 2
    """With selective checkpointing: checkpoint every this many blocks."""
    compile: bool = False
    """torch.compile each block (whole model under TP) and the loss; the first step pays the compile."""
    eval_every: int = 50
    """Steps between validation passes; 0 = only at the end."""
    eval_batches: int = 4
    """Global batches of validation data per pass."""
    peak_tflops: float = 0.0
    """Per-device peak for MFU; 0 = look up the GPU or measure the CPU."""
    stop_at_step: int = 0
    """Checkpoint and exit 0 after this step (a long schedule as a chain of jobs); 0: run to the end."""
    time_limit: str = ""
    """Wall-clock budget, "HH:MM:SS" or seconds (Slurm --time, ABCI h_rt): checkpoint and exit 0 before it."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A NaN/Inf loss or gradient norm: skip the update, or stop with an error."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (within a node). DP = world / (tp x pp)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    dp_replicate: int = 1
    """> 1 with zero 2/3: hybrid sharding, shard within groups of DP / dp_replicate and replicate across."""
    zero: int = 0
    """0: DDP; 1: + optimizer states sharded; 2: + gradients sharded (FSDP2); 3: + parameters sharded (FSDP2)."""
    sequence_parallel: bool = True
    """With tp > 1: norms and residuals sharded along the sequence."""
    loss_parallel: bool = True
    """With tp > 1: cross-entropy on vocabulary-sharded logits."""
    pp_schedule: Literal[PP_SCHEDULES] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble or zbv."""
    pp_microbatches: int = 0
    """0: derived, local batch / training.micro_batch_size (a set value must equal it)."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved schedules need >= 2, zbv exactly 2)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints (0: none, except on preemption and planned stops)."""
    keep: int = 3
    """Committed checkpoints kept; older ones are deleted after a newer one commits."""
    async_: bool = False
    """TOML key `async`: DCP async save, training continues while it writes."""
    resume: str = "auto"
    """"auto": the latest committed checkpoint in dir, if any; "none"; or a path."""
    dir: str = ""
    """Default: <run.dir>/checkpoints."""


@dataclass
class LaunchConfig:
    env: Literal[LAUNCHERS] = "auto"
    """Who started the processes: "auto" detects torchrun, Slurm, Open MPI, MPICH, AzureML; or force one."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": CUDA (NCCL) where there is a GPU, else CPU (gloo); "cpu" forces the CPU on a GPU machine."""


@dataclass
class RunConfig:
    dir: str = "runs/tiny"
    """Where metrics, TensorBoard events, the resolved config, checkpoints and the weights go."""
    log_every: int = 10
    """Steps between logged metrics."""
    log_level: Literal[LOG_LEVELS] = "info"
    """Rank 0 prints at this level; other ranks print warnings and errors."""
    progress: bool = True
    """Rich progress bar on rank 0 (only drawn on a terminal)."""
    tensorboard: bool = True
    """Write TensorBoard events to <dir>/tb."""
    save_model: bool = True
    """At the end, write the weights to <dir>/model.safetensors (above save_model_max_gb: export the last
    checkpoint with `meshtrain export` instead)."""
    save_model_max_gb: float = 8.0
    """Largest model whose full weights are gathered into one process at the end."""
    sample_prompt: str = "def "
    """After training, rank 0 prints a continuation of this; "" to skip."""
    sample_tokens: int = 48
    """Tokens in that sample."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def model_args(self, vocab_size: int | None = None, base: ModelArgs | None = None) -> ModelArgs:
        """`base` (default: the preset) with this config's overrides; `vocab_size` fills an unset one."""
        args = dataclasses.replace(base or PRESETS[self.model.preset])
        for f in dataclasses.fields(ModelArgs):
            value = getattr(self.model, f.name, None)
            if value is not None:
                setattr(args, f.name, value)
        if self.model.vocab_size is None and vocab_size is not None and base is None:
            args.vocab_size = vocab_size
        return args


ALIASES = {"async": "async_"}  # TOML keys that are Python keywords
SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def config_keys() -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, help) for every key: the `meshtrain train --help` listing."""
    inverse = {v: k for k, v in ALIASES.items()}
    keys = []
    for section, cls in typing.get_type_hints(Config).items():
        hints, docs, defaults = typing.get_type_hints(cls), field_docs(cls), cls()
        for f in dataclasses.fields(cls):
            keys.append((f"{section}.{inverse.get(f.name, f.name)}", hints[f.name], getattr(defaults, f.name),
                         docs.get(f.name, "")))
    return keys


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or start from defaults), apply `--section.key value` overrides, check values."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (the shipped ones are in configs/)")
        try:
            raw = tomllib.loads(p.read_text())
        except UnicodeDecodeError:
            raise ConfigError(f"config file {p} is not text: pass a TOML file such as configs/tiny.toml") from None
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
    section = getattr(cfg, section_name, None) if section_name in SECTIONS else None
    if section is None or "." in name:
        raise ConfigError(f"unknown config key {key!r}: sections are {', '.join(SECTIONS)}")
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        raise ConfigError(f"unknown config key {key!r}: keys of [{section_name}] are {', '.join(_field_names(section))}")
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
            raise ConfigError(f"unknown config key {dotted!r}: keys of {where} are {', '.join(_field_names(cls))}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted!r} must be a table [{dotted}]")
            kwargs[key] = _build(hints[key], value, f"{dotted}.")
        else:
            kwargs[key] = _check_type(value, hints[key], dotted)
    return cls(**kwargs)


def describe_type(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(hint) if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check_type(value, args[0], key)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key} = {value!r} is not allowed: use {describe_type(hint)}")
        return value
    ok = ((hint is bool and isinstance(value, bool))
          or (hint is int and isinstance(value, int) and not isinstance(value, bool))
          or (hint is float and isinstance(value, (int, float)) and not isinstance(value, bool))
          or (hint is str and isinstance(value, str)))
    if not ok:
        raise ConfigError(f"{key} = {value!r} has the wrong type: it must be {describe_type(hint)}")
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} must be a finite number")
    return float(value) if hint is float else value


def _from_text(text: str, hint: Any, key: str) -> Any:
    """Parse a command-line string by the field's type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null"):
            return None
        return _from_text(text, next(a for a in typing.get_args(hint) if a is not type(None)), key)
    if origin is Literal or hint is str:
        return _check_type(text, hint, key)
    try:
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        return _check_type(hint(text), hint, key)
    except ValueError:
        raise ConfigError(f"--{key} {text!r} has the wrong type: it must be {describe_type(hint)}") from None


# ---------------------------------------------------------------------------------------------
# Value checks


def _positive(value: int | float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key} = {value} must be positive")


def _at_least_zero(obj: Any, section: str, *keys: str) -> None:
    for key in keys:
        if getattr(obj, key) < 0:
            raise ConfigError(f"{section}.{key} = {getattr(obj, key)} must be >= 0")


def validate(cfg: Config) -> None:
    """Checks of single values and of the preset's shape; no world size or data needed."""
    m, t, r, c = cfg.model, cfg.training, cfg.run, cfg.checkpoint
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset = {m.preset!r} is unknown: use one of {', '.join(PRESETS)}")
    if m.init_from and not (m.init_from.startswith("hf:") and Path(m.init_from[3:], "config.json").is_file()):
        raise ConfigError(f"model.init_from = {m.init_from!r}: use \"hf:DIR\" with a local Hugging Face Llama "
                          "directory (config.json + safetensors)")
    for key in ("steps", "global_batch_size", "micro_batch_size", "seq_len", "lr", "eval_batches", "ac_every"):
        _positive(getattr(t, key), f"training.{key}")
    for key in ("log_every", "sample_tokens", "save_model_max_gb"):
        _positive(getattr(r, key), f"run.{key}")
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
                "rope_theta", "norm_eps", "vocab_multiple"):
        if getattr(m, key) is not None:
            _positive(getattr(m, key), f"model.{key}")
    _at_least_zero(t, "training", "warmup_steps", "eval_every", "grad_clip", "weight_decay", "peak_tflops",
                   "stop_at_step")
    _at_least_zero(c, "checkpoint", "every")
    _positive(c.keep, "checkpoint.keep")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"training.min_lr_ratio = {t.min_lr_ratio} must be between 0 and 1")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"training.{key} = {getattr(t, key)} must be at least 0 and below 1 (AdamW)")
    if t.stop_at_step > t.steps:
        raise ConfigError(f"training.stop_at_step = {t.stop_at_step} must be between 0 and training.steps ({t.steps})")
    parse_duration(t.time_limit, "training.time_limit")
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(f"checkpoint.resume = {c.resume!r}: no such checkpoint (use auto, none or a path)")
    if not m.init_from:
        check_model_args(cfg.model_args(), cfg)


def check_model_args(args: ModelArgs, cfg: Config, data_vocab_size: int | None = None) -> None:
    """The resolved model shape against itself, the sequence length and the data's vocabulary."""
    if args.dim % args.n_heads:
        raise ConfigError(f"model.dim ({args.dim}) must be divisible by model.n_heads ({args.n_heads})")
    if args.head_dim % 2:
        raise ConfigError(f"head dimension model.dim / model.n_heads = {args.head_dim} must be even for rotary "
                          "embeddings")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_heads ({args.n_heads}) must be a multiple of model.n_kv_heads ({args.n_kv_heads})")
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len ({cfg.training.seq_len}) is longer than the model allows "
                          f"(model.max_seq_len = {args.max_seq_len}); lower it or raise model.max_seq_len")
    explicit_vocab = cfg.model.vocab_size is not None or cfg.model.init_from
    if data_vocab_size is not None and explicit_vocab and args.vocab_size < data_vocab_size:
        raise ConfigError(f"the model's vocabulary ({args.vocab_size}) is smaller than the data's ({data_vocab_size}); "
                          "leave model.vocab_size unset to use the data's, or use data tokenized for model.init_from")


def parse_duration(text: str, key: str) -> float:
    """"HH:MM:SS", "MM:SS", "D-HH:MM:SS" (Slurm) or seconds -> seconds; "" -> 0 (no limit)."""
    if not text:
        return 0.0
    try:
        days, _, clock = text.rpartition("-")
        parts = [float(x) for x in clock.split(":")]
        if len(parts) > 3 or not all(math.isfinite(p) and p >= 0 for p in parts):
            raise ValueError
        seconds = sum(v * 60**i for i, v in enumerate(reversed(parts))) + (86400 * int(days) if days else 0)
    except ValueError:
        raise ConfigError(f'{key} = "{text}" is not a duration: use "HH:MM:SS" or seconds') from None
    if seconds <= 0:
        raise ConfigError(f"{key} = {text!r} must be positive")
    return seconds


def micro_batches(t: TrainingConfig, dp: int) -> int:
    """Micro-batches per step on one rank: accumulation steps, or the pipeline schedule's micro-batches."""
    return t.global_batch_size // (t.micro_batch_size * dp)


def to_toml(cfg: Config) -> str:
    inverse = {v: k for k, v in ALIASES.items()}

    def drop_none(d: dict) -> dict:
        return {inverse.get(k, k): drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

    return tomli_w.dumps(drop_none(dataclasses.asdict(cfg)))


def resolved(cfg: Config, args: ModelArgs) -> Config:
    """The config with the model's shape spelled out (what `<run.dir>/config.toml` holds)."""
    out = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    for f in dataclasses.fields(ModelArgs):
        setattr(out.model, f.name, getattr(args, f.name))
    return out
