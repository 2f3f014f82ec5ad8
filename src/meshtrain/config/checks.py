"""Value checks that need no process group: single values, and the model's resolved shape against
the sequence length and the data. Layout checks live with the layout (`ParallelDims.validate`)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from meshtrain.config.schema import Config, ModelArgs
from meshtrain.errors import ConfigError
from meshtrain.model.presets import PRESETS


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
        raise ConfigError(
            f'model.init_from = {m.init_from!r}: use "hf:DIR" with a local Hugging Face Llama '
            "directory (config.json + safetensors)"
        )
    for key in ("steps", "global_batch_size", "micro_batch_size", "seq_len", "lr", "eval_batches", "ac_every"):
        _positive(getattr(t, key), f"training.{key}")
    for key in ("log_every", "sample_tokens", "save_model_max_gb"):
        _positive(getattr(r, key), f"run.{key}")
    for key in (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "vocab_size",
        "max_seq_len",
        "rope_theta",
        "norm_eps",
        "vocab_multiple",
    ):
        if getattr(m, key) is not None:
            _positive(getattr(m, key), f"model.{key}")
    _at_least_zero(
        t, "training", "warmup_steps", "eval_every", "grad_clip", "weight_decay", "peak_tflops", "stop_at_step"
    )
    _at_least_zero(c, "checkpoint", "every")
    for key in ("tp", "pp", "dp_replicate", "pp_virtual_stages"):
        _positive(getattr(cfg.parallel, key), f"parallel.{key}")
    if cfg.parallel.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {cfg.parallel.zero} is not allowed: use 0 (DDP), 1, 2 or 3")
    _positive(c.keep, "checkpoint.keep")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"training.min_lr_ratio = {t.min_lr_ratio} must be between 0 and 1")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"training.{key} = {getattr(t, key)} must be at least 0 and below 1 (AdamW)")
    if t.stop_at_step > t.steps:
        raise ConfigError(f"training.stop_at_step = {t.stop_at_step} must be between 0 and training.steps ({t.steps})")
    parse_duration(t.time_limit, "training.time_limit")
    parse_data_path(cfg.data.path)
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(f"checkpoint.resume = {c.resume!r}: no such checkpoint (use auto, none or a path)")
    if not m.init_from:
        check_model_args(cfg.model_args(), cfg)


def check_model_args(args: ModelArgs, cfg: Config, data_vocab_size: int | None = None) -> None:
    """The resolved model shape against itself, the sequence length and the data's vocabulary."""
    if args.dim % args.n_heads:
        raise ConfigError(f"model.dim ({args.dim}) must be divisible by model.n_heads ({args.n_heads})")
    if args.head_dim % 2:
        raise ConfigError(
            f"head dimension model.dim / model.n_heads = {args.head_dim} must be even for rotary embeddings"
        )
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_heads ({args.n_heads}) must be a multiple of model.n_kv_heads ({args.n_kv_heads})")
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len ({cfg.training.seq_len}) is longer than the model allows "
            f"(model.max_seq_len = {args.max_seq_len}); lower it or raise model.max_seq_len"
        )
    explicit_vocab = cfg.model.vocab_size is not None or cfg.model.init_from
    if data_vocab_size is not None and explicit_vocab and args.vocab_size < data_vocab_size:
        raise ConfigError(
            f"the model's vocabulary ({args.vocab_size}) is smaller than the data's ({data_vocab_size}); "
            "leave model.vocab_size unset to use the data's, or use data tokenized for model.init_from"
        )


SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)


def parse_data_path(text: str) -> list[tuple[str, float]]:
    """data.path: one prepared directory, or a blend "DIR:WEIGHT,DIR:WEIGHT,..." -> [(dir, share)]
    with the shares summing to 1."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ConfigError(f"data.path = {text!r} has an empty entry: use DIR or DIR:WEIGHT,DIR:WEIGHT")
    sources = []
    for item in items:
        path, _, weight = item.rpartition(":")
        try:
            value = float(weight) if path else None
        except ValueError:
            value = None
        if value is None:
            if len(items) > 1:
                raise ConfigError(f"data.path = {text!r}: {item!r} has no weight; give every source one, DIR:WEIGHT")
            return [(item, 1.0)]
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"data.path = {text!r}: the weight of {path} is {weight}; weights must be above 0")
        sources.append((path, value))
    paths = [p for p, _ in sources]
    if len(set(paths)) < len(paths):
        raise ConfigError(f"data.path = {text!r} names a directory twice: give each source once")
    total = sum(w for _, w in sources)
    return [(p, w / total) for p, w in sources]


def parse_size(text: str) -> int:
    """The one size grammar of every flag and key: bytes, or a number with K, M, G or T (binary
    multiples; a trailing B or iB is allowed): "4096", "64M", "1.5G", "5GB", "500MiB"."""
    m = SIZE.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a size: write bytes or a number with K, M, G or T (64M, 5G, 5GB)")
    value = int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def parse_duration(text: str, key: str) -> float:
    """ "HH:MM:SS", "MM:SS", "D-HH:MM:SS" (Slurm) or seconds -> seconds; "" -> 0 (no limit)."""
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
