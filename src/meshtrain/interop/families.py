"""Hugging Face `config.json` <-> ModelArgs for the dense decoder families meshtrain imports and
exports: llama (1, 2, 3, 3.1, 3.2, 3.3), mistral, qwen2 (Qwen2, Qwen2.5) and qwen3.

Every field of a config.json is one of three kinds, and a field of none of them is refused by name:
- it sets the computation and is read into ModelArgs (sizes, RoPE and its scaling, biases, norms);
- it must have the value meshtrain computes with (hidden_act silu, no attention dropout, no active
  sliding window, no quantization), and any other value is refused by name with the fix;
- it does not change the computation (token ids, dtype, initializer range, transformers_version).
Both RoPE spellings are read: transformers 5's `rope_parameters` and 4's `rope_theta` + `rope_scaling`.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.errors import MeshtrainError
from meshtrain.fields import LARGEST_COUNT, LARGEST_NUMBER, LARGEST_SIZE, whole
from meshtrain.model.args import MAX_POSITIONS, ModelArgs
from meshtrain.model.family import FAMILIES, NOT_BUILT, inexpressible
from meshtrain.model.rope import ROPE_TYPES

COMMON = frozenset(
    {
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "head_dim",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "hidden_act",
        "attention_dropout",
    }
)
# Fields that do not change what the model computes from its weights.
METADATA = frozenset(
    {
        "architectures",
        "model_type",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "pretraining_tp",  # Llama 2's sliced matmuls: the same products, summed in another order
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "tokenizer_class",
    }
)
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# transformers' defaults
DEFAULT_POSITIONS = {
    "llama": 2048,
    "mistral": 131072,
    "qwen2": 32768,
    "qwen3": 32768,
    "qwen3_moe": 32768,
    "mixtral": 131072,
}


def refuse(where: str, message: str) -> MeshtrainError:
    return MeshtrainError(f"{where}: {message}")


def config_to_args(c: dict, where: str, vocab_multiple: int = 64) -> ModelArgs:
    """The ModelArgs of a config.json, or the one-line reason meshtrain cannot compute it exactly."""
    family_name = c.get("model_type")
    family = FAMILIES.get(family_name) if isinstance(family_name, str) else None
    if family is None:
        known = isinstance(family_name, str) and family_name in NOT_BUILT
        lacks = f"meshtrain does not compute {NOT_BUILT[family_name]}" if known else ""
        raise refuse(
            where,
            f"model_type {family_name!r} is not a family meshtrain imports ({', '.join(FAMILIES)})"
            + (f": {lacks}" if lacks else "; multimodal and sliding-window-only models are not supported"),
        )
    if "quantization_config" in c:
        method = (c["quantization_config"] or {}).get("quant_method", "?")
        raise refuse(where, f"quantization_config: the weights are quantized ({method}); import the unquantized model")
    unknown = sorted(set(c) - COMMON - METADATA - family.fields)
    if unknown:
        raise refuse(
            where,
            f"{', '.join(unknown)}: not a {family_name} field meshtrain knows, so it may change the computation; "
            "remove it from config.json if it does not",
        )
    for key in REQUIRED:
        if not whole(c.get(key), 1, LARGEST_SIZE):
            raise refuse(
                where,
                f"{key} is {'missing' if key not in c else repr(c[key])}: it must be a positive integer "
                f"(at most {LARGEST_SIZE:,})",
            )
    _check_types(c, where)
    if c.get("hidden_act", "silu") != "silu":
        raise refuse(where, f"hidden_act {c['hidden_act']!r}: meshtrain's MLP is SwiGLU (silu)")
    if c.get("attention_dropout", 0.0) != 0 or isinstance(c.get("attention_dropout"), bool):
        raise refuse(where, f"attention_dropout {c['attention_dropout']!r}: set it to 0.0 (meshtrain has no dropout)")
    max_positions = c.get("max_position_embeddings", DEFAULT_POSITIONS[family_name])
    _check_sliding_window(c, family_name, max_positions, where)
    theta, scaling = read_rope(c, max_positions, where)
    n_heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or (128 if family_name == "qwen3" else None)  # Qwen3Config's default (not MoE's)
    bias = c.get("attention_bias", False)
    moe = read_experts(c, family_name, where) if family.moe else {}
    return ModelArgs(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads") or n_heads,
        ffn_dim=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=max_positions,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=c.get("tie_word_embeddings", False),
        head_dim=head_dim if head_dim and head_dim != c["hidden_size"] // n_heads else None,
        qkv_bias=family.qkv_bias if family.qkv_bias is not None else bias,
        out_bias=bias if family.qkv_bias is None else False,
        mlp_bias=c.get("mlp_bias", False),
        qk_norm=family.qk_norm,
        family=family_name,
        vocab_multiple=vocab_multiple,
        **moe,
    )


def read_experts(c: dict, family: str, where: str) -> dict:
    """The ModelArgs of a Mixtral or Qwen3-MoE config's mixture of experts."""
    n_key = "num_local_experts" if family == "mixtral" or "num_experts" not in c else "num_experts"
    ints = {n_key: None, "num_experts_per_tok": None, "moe_intermediate_size": None, "decoder_sparse_step": 1}
    if family == "mixtral":
        del ints["moe_intermediate_size"], ints["decoder_sparse_step"]
    for key, default in ints.items():
        value = c.get(key, default)
        if not whole(value, 1, LARGEST_SIZE):
            raise refuse(
                where,
                f"{key} is {'missing' if key not in c else repr(value)}: it must be a positive integer "
                f"(at most {LARGEST_SIZE:,})",
            )
    if family == "qwen3_moe" and c.get("num_local_experts", c[n_key]) != c[n_key]:
        raise refuse(where, "num_experts and num_local_experts disagree: keep one of them")
    n_experts, top_k = c[n_key], c["num_experts_per_tok"]
    if top_k > n_experts:
        raise refuse(where, f"num_experts_per_tok {top_k} is more than the {n_experts} experts")
    coef = c.get("router_aux_loss_coef", 0.001)
    check_positive_number(coef, "router_aux_loss_coef", where, zero=True)
    if family == "mixtral":
        if c.get("router_jitter_noise", 0.0):
            raise refuse(
                where, f"router_jitter_noise {c['router_jitter_noise']}: meshtrain routes without noise; set it to 0.0"
            )
        return {"n_experts": n_experts, "top_k": top_k, "norm_topk": True, "aux_loss_coef": float(coef)}
    dense = [] if c.get("mlp_only_layers") is None else c["mlp_only_layers"]
    if not isinstance(dense, list) or not all(whole(i, 0, c["num_hidden_layers"] - 1) for i in dense):
        raise refuse(where, f"mlp_only_layers is {dense!r}: it must be a list of layer indices")
    norm = c.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise refuse(where, f"norm_topk_prob is {norm!r}: it must be true or false")
    return {
        "n_experts": n_experts,
        "top_k": top_k,
        "moe_ffn_dim": c["moe_intermediate_size"],
        "moe_every": c.get("decoder_sparse_step", 1),
        "dense_layers": tuple(dense),
        "norm_topk": norm,
        "aux_loss_coef": float(coef),
    }


MISTRAL_DEFAULT_WINDOW = 4096
# Optional config.json fields and what each must be where present (transformers' config classes
# refuse the same): "a" string "false" must not read as true, a null epsilon must not become torch's.
FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "output_router_logits")
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
POSITIVE_INTS = ("max_position_embeddings",)
POSITIVE_INTS_OR_NULL = ("num_key_value_heads", "head_dim", "sliding_window")
COUNTS_OR_NULL = ("max_window_layers",)  # Qwen2's layers without a window: read with use_sliding_window alone


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # read by generate, serve and export


def _check_types(c: dict, where: str) -> None:
    for key in (k for k in TOKEN_IDS if c.get(k) is not None):
        ids = c[key] if isinstance(c[key], list) else [c[key]]
        if not ids or not all(whole(i, 0, LARGEST_SIZE) for i in ids):
            if not (key == "pad_token_id" and c[key] == -1):  # Llama 2's: no padding token
                raise refuse(where, f"{key} is {c[key]!r}: it must be a token id (or a list of them, or null)")
    for key in (k for k in ("torch_dtype", "dtype") if c.get(k) is not None):
        if c[key] not in ("float32", "float16", "bfloat16"):
            raise refuse(where, f"{key} is {c[key]!r}: it must be float32, float16 or bfloat16")
    for key in (k for k in FLAGS if k in c):
        if not isinstance(c[key], bool):
            raise refuse(where, f"{key} is {c[key]!r}: it must be true or false")
    for key in (k for k in POSITIVE_NUMBERS if k in c):
        check_positive_number(c[key], key, where)
    if c.get("rms_norm_eps", 1e-6) >= 1:
        raise refuse(where, f"rms_norm_eps is {c['rms_norm_eps']!r}: it must be below 1 (1e-5 or 1e-6 in most models)")
    for key in (k for k in (*POSITIVE_INTS, *POSITIVE_INTS_OR_NULL, *COUNTS_OR_NULL) if k in c):
        if c[key] is None and key not in POSITIVE_INTS:
            continue
        low = 0 if key in COUNTS_OR_NULL else 1
        bounded = key not in POSITIVE_INTS  # max_position_embeddings: MAX_POSITIONS, below
        if not whole(c[key], low, LARGEST_SIZE if bounded else LARGEST_COUNT):
            kind = "non-negative" if low == 0 else "positive"
            raise refuse(where, f"{key} is {c[key]!r}: it must be a {kind} integer (at most {LARGEST_SIZE:,})")
    if c.get("max_position_embeddings", 0) > MAX_POSITIONS:
        raise refuse(
            where,
            f"max_position_embeddings {c['max_position_embeddings']:,} is more positions than meshtrain's "
            f"rotary tables hold ({MAX_POSITIONS:,}): lower it to the context the model is used at",
        )


def check_positive_number(value, key: str, where: str, zero: bool = False) -> None:
    """A finite number above 0 (or 0 itself, with `zero`) and at most LARGEST_NUMBER: not a string,
    a boolean, null, NaN or an infinity (JSON readers accept `NaN` and `Infinity`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value if zero else 0 < value):
        raise refuse(where, f"{key} is {value!r}: it must be a {'non-negative' if zero else 'positive'} number")
    if not math.isfinite(value) or value > LARGEST_NUMBER:
        raise refuse(where, f"{key} is {value!r}: it must be a finite number up to {LARGEST_NUMBER:g}")


def _check_sliding_window(c: dict, family: str, max_positions: int, where: str, length: str = "") -> None:
    """meshtrain attends over the whole sequence: a window shorter than the model's context is refused.
    `length`: the context's name where it is not config.json's max_position_embeddings (model.max_seq_len,
    raised past it: a window that covered config.json's context may not cover that one)."""
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        if c.get("use_sliding_window"):
            raise refuse(
                where, "use_sliding_window is true: meshtrain attends over the whole sequence; set it to false"
            )
        layer_types = [] if c.get("layer_types") is None else c["layer_types"]
        if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
            raise refuse(where, f"layer_types is {layer_types!r}: it must be a list of attention kinds, or null")
        if any(kind != "full_attention" for kind in layer_types):
            raise refuse(where, "layer_types has sliding_attention layers: meshtrain attends over the whole sequence")
        return
    # transformers' MistralConfig reads a missing sliding_window as 4096 (Mistral 7B v0.1's window)
    window = c.get("sliding_window", MISTRAL_DEFAULT_WINDOW if family == "mistral" else None)
    if window is not None and window < max_positions:
        if length:
            raise refuse(
                where,
                f"{length} {max_positions} is longer than config.json's sliding_window {window}: past it transformers "
                f"attends within the window, meshtrain over the whole sequence; set {length} to {window} or less",
            )
        raise refuse(
            where,
            f"sliding_window {window} is shorter than max_position_embeddings {max_positions}: meshtrain attends "
            f"over the whole sequence; set sliding_window to null (exact for sequences up to {window} tokens)",
        )


def check_longer_context(c: dict, max_seq_len: int, length: str, where: str) -> None:
    """A context raised past config.json's (`length` names the setting) must still fit its sliding window."""
    _check_sliding_window(c, c.get("model_type"), max_seq_len, where, length)


def read_rope(c: dict, max_positions: int, where: str) -> tuple[float, dict | None]:
    """(theta, scaling dict as model/rope.py reads it, or None) from either spelling."""
    modern, legacy = c.get("rope_parameters"), c.get("rope_scaling")
    for key, value in (("rope_parameters", modern), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise refuse(where, f"{key} is {value!r}: it must be an object of RoPE parameters, or null")
    if modern and legacy and {k: v for k, v in modern.items() if k != "rope_theta"} != legacy:
        raise refuse(where, "rope_parameters and rope_scaling disagree: keep one of them")
    params = dict(modern or legacy or {})
    if "rope_theta" in params:
        check_positive_number(params["rope_theta"], "rope_parameters.rope_theta", where)
    if "rope_theta" in params and "rope_theta" in c and float(params["rope_theta"]) != float(c["rope_theta"]):
        raise refuse(where, "rope_theta and rope_parameters.rope_theta disagree: keep one of them")
    theta = float(params.pop("rope_theta", c.get("rope_theta", 10000.0)))
    for key in (k for k in ("rope_type", "type") if k in params):
        if not isinstance(params[key], str):
            raise refuse(where, f"rope_parameters.{key} is {params[key]!r}: it must be the name of a RoPE type")
    if params.get("type", params.get("rope_type")) != params.get("rope_type", params.get("type")):
        raise refuse(where, "rope_parameters: rope_type and type (its older name) disagree: keep one of them")
    kind = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    if params.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(where, "partial_rotary_factor: meshtrain rotates the whole head")
    if kind not in ROPE_TYPES:
        raise refuse(
            where,
            f"rope_type {kind!r} is not supported (use one of {', '.join(ROPE_TYPES)}); dynamic and "
            "longrope rescale with the sequence at run time",
        )
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise refuse(where, f"{', '.join(unknown)}: not a parameter of rope_type {kind!r}")
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_positions)
    missing = {"linear": ["factor"], "llama3": sorted(ROPE_KEYS["llama3"]), "yarn": ["factor"]}[kind]
    if any(params.get(key) is None for key in missing):
        raise refuse(where, f"rope_type {kind!r} needs {', '.join(missing)}")
    for key, value in params.items():
        if key == "truncate":
            if not isinstance(value, bool):
                raise refuse(where, f"rope_parameters.truncate is {value!r}: it must be true or false")
        elif key == "original_max_position_embeddings":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_POSITIONS:
                raise refuse(where, f"rope_parameters.{key} is {value!r}: it must be a positive integer")
        elif value is not None:  # yarn's optional ones may be null: transformers' defaults
            check_positive_number(value, f"rope_parameters.{key}", where, zero=key.startswith("mscale"))
    if kind == "llama3" and not params["low_freq_factor"] < params["high_freq_factor"]:
        raise refuse(where, "rope_parameters: low_freq_factor must be below high_freq_factor")
    return theta, {"rope_type": kind, **params}


def args_to_config(args: ModelArgs, dtype: str, bos_id: int | None, eos_ids: list[int]) -> dict:
    """The config.json of a family's model (transformers 4's RoPE spelling, which 4 and 5, vLLM and
    SGLang all read), or the one-line reason the family cannot express these args."""
    family = FAMILIES.get(args.family)
    if family is None:
        raise MeshtrainError(f"model family {args.family!r} has no Hugging Face export ({', '.join(FAMILIES)})")
    problem = inexpressible(args)
    if problem:
        raise MeshtrainError(f"a {args.family} config.json cannot express this model: {problem}")
    eos = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    c = {
        "architectures": [family.architecture],
        "model_type": args.family,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": dict(args.rope_scaling) if args.rope_scaling else None,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if args.family in ("llama", "qwen3", "qwen3_moe"):
        c["attention_bias"] = args.out_bias
    if args.family == "llama":
        c["mlp_bias"] = args.mlp_bias
    if args.family in ("mistral", "mixtral"):
        c["sliding_window"] = None
    if args.family in ("qwen2", "qwen3"):
        c |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}
    router = {"num_experts_per_tok": args.top_k, "router_aux_loss_coef": args.aux_loss_coef}
    if args.family == "mixtral":
        c |= {"num_local_experts": args.n_experts, "router_jitter_noise": 0.0, **router}
    if args.family == "qwen3_moe":
        dense = sorted(set(args.dense_layers) | set(range(args.first_dense)))
        c |= {"use_sliding_window": False, "sliding_window": None, "num_experts": args.n_experts, **router}
        c |= {"moe_intermediate_size": args.expert_ffn_dim, "decoder_sparse_step": args.moe_every}
        c |= {"mlp_only_layers": dense, "norm_topk_prob": args.norm_topk}
    return c


def same_model(a: ModelArgs, b: ModelArgs) -> bool:
    """Equal in everything the config.json says (not meshtrain's vocabulary padding; a head dimension
    of dim / n_heads whether it is written or not)."""

    def canonical(args: ModelArgs) -> ModelArgs:
        return dataclasses.replace(args, vocab_multiple=0, head_dim=args.head_size)

    return canonical(a) == canonical(b)


def export_config(args: ModelArgs, source: dict | None, dtype: str, bos_id: int | None, eos_ids: list[int]) -> dict:
    """An imported model's own config.json where the run kept its computation (a fine-tune), so that
    import -> export gives the same file; a fresh one otherwise, with the source's token ids."""
    if source is not None and same_model(config_to_args(source, "config.json"), args):
        return {**source, **{key: dtype for key in ("torch_dtype", "dtype") if key in source}}
    fresh = args_to_config(args, dtype, bos_id, eos_ids)
    if source is not None:
        fresh |= {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source}
    return fresh
