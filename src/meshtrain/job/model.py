"""A job's model resolved once: the preset, or model.init_from's config.json, with the config's
overrides (`model_args`), its shape facts (`Shape`), its adapters ([peft]), and the rules that refuse
it: the shape against itself, the sequence length, the data's vocabulary and the pretrained weights.
A model option is declared in config/schema.py (ModelConfig) and model/args.py (ModelArgs) under one
name; it reaches the model from here, and nothing else lists it."""

from __future__ import annotations

import dataclasses

from meshtrain.config import Config, ModelConfig
from meshtrain.config.schema import DEFAULT_PRESET, PeftConfig
from meshtrain.errors import ConfigError
from meshtrain.model.args import GROUPS, LoraSpec, ModelArgs, parse_targets
from meshtrain.model.presets import PRESETS
from meshtrain.model.shapes import Shape

# What a fine-tune may change of model.init_from's model: the context length, the vocabulary's padding
# and how experts are balanced in training; config.json fixes every other key the config declares.
TRAINING_KEYS = (
    "max_seq_len",
    "vocab_multiple",
    "capacity_factor",
    "load_balance",
    "aux_loss_coef",
    "bias_update_rate",
)
SHAPE_KEYS = tuple(
    f.name
    for f in dataclasses.fields(ModelArgs)
    if f.name in ModelConfig.__dataclass_fields__ and f.name not in TRAINING_KEYS
)


def resolve_model(cfg: Config, data_vocab_size: int | None = None) -> tuple[ModelArgs, Shape]:
    """The model's shape (`model_args`) and its parameter and FLOP facts."""
    args = model_args(cfg, data_vocab_size)
    return args, Shape.from_args(args)


def adapters_of(peft: PeftConfig, moe: bool = False) -> LoraSpec | None:
    """[peft] with its defaults resolved (rank 8, alpha 2 x rank, no dropout, every linear: the
    attention's of a mixture of experts, `moe`); None when peft.method is "none" (every weight trains)."""
    if peft.method == "none":
        return None
    rank = peft.rank or 8
    alpha = peft.alpha if peft.alpha is not None else 2.0 * rank
    targets = parse_targets(peft.targets or ("attention" if moe else None))
    if moe and (mlp := [name for name in targets if name in GROUPS["mlp"]]):
        raise ConfigError(
            f"peft.targets = {peft.targets!r} puts adapters on {', '.join(mlp)}, but a mixture of experts' routed "
            "experts take none: set peft.targets = attention"
        )
    return LoraSpec(peft.method, rank, alpha, peft.dropout or 0.0, targets)


def with_overrides(cfg: Config, base: ModelArgs, vocab_size: int | None = None) -> ModelArgs:
    """`base` with the config's model keys that are set; `vocab_size` (the data's) fills an unset one."""
    given = {f.name: getattr(cfg.model, f.name, None) for f in dataclasses.fields(ModelArgs)}
    args = dataclasses.replace(base, **{name: value for name, value in given.items() if value is not None})
    if cfg.model.vocab_size is None and vocab_size is not None:
        args.vocab_size = vocab_size
    return args


def model_args(cfg: Config, data_vocab_size: int | None = None) -> ModelArgs:
    """The model's shape: the preset, or a Hugging Face directory's config.json, with the overrides;
    checked against the sequence and the data's vocabulary (`data_vocab_size`, where known)."""
    if not cfg.model.init_from:
        args = with_overrides(cfg, PRESETS[cfg.model.preset or DEFAULT_PRESET], data_vocab_size)
        check_model_args(args, cfg, data_vocab_size)
        return args
    from meshtrain.interop.hf_import import check_context_length, hf_model_args

    if cfg.model.preset is not None:
        raise ConfigError(
            f"model.preset = {cfg.model.preset!r} but model.init_from's config.json is the model's shape: "
            "drop model.preset (or model.init_from, to train the preset from scratch)"
        )
    directory = cfg.model.init_from.removeprefix("hf:")
    base = hf_model_args(directory)
    for key in SHAPE_KEYS:  # its weights have this shape: a key that says otherwise cannot hold
        value, theirs = getattr(cfg.model, key), base.head_size if key == "head_dim" else getattr(base, key)
        if value is not None and value != theirs:
            raise ConfigError(
                f"model.{key} = {value} but model.init_from's config.json has {theirs}: drop "
                f"model.{key} (the pretrained weights fix it; only max_seq_len and vocab_multiple may change)"
            )
    args = with_overrides(cfg, base)
    if args.max_seq_len > base.max_seq_len:
        check_context_length(directory, args.max_seq_len)
    check_model_args(args, cfg, data_vocab_size)
    return args


def check_model_args(args: ModelArgs, cfg: Config, data_vocab_size: int | None = None) -> None:
    """The resolved model shape against itself, the sequence length and the data's vocabulary."""
    from meshtrain.model.family import inexpressible

    if problem := inexpressible(args):
        raise ConfigError(
            f"model.family = {args.family!r} has no {problem}: pick the family whose architecture has it "
            "(qwen2: qkv_bias; qwen3: qk_norm; qwen3_moe, mixtral: experts; meshtrain: any, without a Hugging "
            "Face export) or drop the option"
        )
    check_experts(args)
    if args.head_dim is None and args.dim % args.n_heads:
        raise ConfigError(f"model.dim ({args.dim}) must be divisible by model.n_heads ({args.n_heads})")
    if args.head_size % 2:
        raise ConfigError(f"the head dimension ({args.head_size}) must be even for rotary embeddings")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_heads ({args.n_heads}) must be a multiple of model.n_kv_heads ({args.n_kv_heads})")
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len ({cfg.training.seq_len}) is longer than the model allows "
            f"(model.max_seq_len = {args.max_seq_len}); lower it or raise model.max_seq_len"
        )
    given_tokens = cfg.run.sample_tokens != type(cfg.run)().sample_tokens  # the default is cut to fit
    if cfg.run.sample_prompt and given_tokens and cfg.run.sample_tokens >= args.max_seq_len:
        raise ConfigError(
            f"run.sample_tokens = {cfg.run.sample_tokens} would not fit the model's context beside the prompt "
            f"(model.max_seq_len = {args.max_seq_len}): lower it"
        )
    explicit_vocab = cfg.model.vocab_size is not None or cfg.model.init_from
    if data_vocab_size is not None and explicit_vocab and args.vocab_size < data_vocab_size:
        raise ConfigError(
            f"the model's vocabulary ({args.vocab_size}) is smaller than the data's ({data_vocab_size}); "
            "leave model.vocab_size unset to use the data's, or use data tokenized for model.init_from"
        )


def check_experts(args: ModelArgs) -> None:
    """The mixture of experts against itself (model/moe.py)."""
    if not args.n_experts:
        return
    if args.top_k > args.n_experts:
        raise ConfigError(f"model.top_k ({args.top_k}) is more than model.n_experts ({args.n_experts})")
    if args.n_experts % args.expert_groups:
        raise ConfigError(
            f"model.n_experts ({args.n_experts}) must be a multiple of model.expert_groups ({args.expert_groups})"
        )
    if args.kept_groups > args.expert_groups:
        raise ConfigError(
            f"model.groups_kept ({args.groups_kept}) is more than model.expert_groups ({args.expert_groups})"
        )
    if args.kept_groups * (args.n_experts // args.expert_groups) < args.top_k:
        raise ConfigError(
            f"model.groups_kept ({args.kept_groups}) groups of {args.n_experts // args.expert_groups} experts hold "
            f"fewer than model.top_k ({args.top_k}): keep more groups"
        )
    if not args.moe_layers:
        raise ConfigError(
            f"model.n_experts = {args.n_experts} but no layer is an MoE layer (model.first_dense = {args.first_dense}, "
            f"model.moe_every = {args.moe_every} of {args.n_layers} layers): lower them"
        )
