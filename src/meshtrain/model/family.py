"""The families of dense decoders the one model covers, and what each family's architecture fixes:
its Hugging Face class name, which of the model's options it has (biases, q/k norms) and the
config.json fields it reads beside the common ones. A config naming a family is checked against
it before training, so a model that its family's format cannot express is refused at the start,
not at export."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.model.args import ModelArgs

SLIDING = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})
ROUTER = frozenset({"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"})


@dataclass(frozen=True)
class Family:
    architecture: str
    fields: frozenset[str]  # the family's own fields beside the common ones
    qkv_bias: bool | None = None  # fixed by the family (Qwen2: always); None: from attention_bias
    qk_norm: bool = False
    moe: bool = False  # a mixture of experts in place of the MLP (model/moe.py)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", frozenset({"attention_bias", "mlp_bias"})),
    "mistral": Family("MistralForCausalLM", frozenset({"sliding_window"})),
    "qwen2": Family("Qwen2ForCausalLM", SLIDING, qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", SLIDING | {"attention_bias"}, qk_norm=True),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        SLIDING
        | ROUTER
        | {"attention_bias", "num_experts", "num_local_experts", "moe_intermediate_size"}
        | {"decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"},
        qk_norm=True,
        moe=True,
    ),
    "mixtral": Family(
        "MixtralForCausalLM", ROUTER | {"sliding_window", "num_local_experts", "router_jitter_noise"}, moe=True
    ),
}

# Families people ask for that the one model does not compute, and what it lacks for each.
NOT_BUILT = {
    "deepseek_v3": "DeepSeek-V3's multi-head latent attention (MLA)",
    "deepseek_v2": "DeepSeek-V2's multi-head latent attention (MLA)",
    "gpt_oss": "GPT-OSS's attention sinks and alternating sliding windows",
    "qwen2_moe": "Qwen2-MoE's gated shared expert",
    "llama4": "Llama 4's chunked attention and interleaved no-RoPE layers",
}


def inexpressible(args: ModelArgs) -> str | None:
    """What of args the family's architecture has no place for (None: all of it fits; family "meshtrain":
    a model of any options, with no Hugging Face export)."""
    family = FAMILIES.get(args.family)
    if family is None:
        return None
    wants_qkv = family.qkv_bias if family.qkv_bias is not None else args.out_bias
    if args.qkv_bias != wants_qkv:
        return f"qkv_bias={args.qkv_bias} with out_bias={args.out_bias}"
    if family.qkv_bias is not None and args.out_bias:
        return "a bias on the attention output"
    if args.mlp_bias and args.family != "llama":
        return "MLP biases"
    if args.qk_norm != family.qk_norm:
        return f"qk_norm={args.qk_norm}"
    if args.family == "mistral" and args.qkv_bias:
        return "attention biases"
    return moe_inexpressible(args, family)


def moe_inexpressible(args: ModelArgs, family: Family) -> str | None:
    """What of the mixture of experts the family's config.json cannot say (None: all of it)."""
    if not family.moe:
        return f"mixture of experts (n_experts={args.n_experts}): use qwen3_moe or mixtral" if args.n_experts else None
    if not args.n_experts:
        return "dense layers only (n_experts=0)"
    if args.router_score != "softmax" or args.expert_groups > 1 or args.n_shared_experts:
        return "a sigmoid router, expert groups or shared experts (DeepSeek-V3's)"
    if args.load_balance == "bias":
        return "aux-loss-free balancing's bias on the routing (load_balance = bias)"
    if args.family == "mixtral":
        if not args.norm_topk:
            return "norm_topk=false (Mixtral renormalises the top-k weights)"
        if args.moe_layers != tuple(range(args.n_layers)) or args.expert_ffn_dim != args.ffn_dim:
            return "dense layers, or experts of another size than ffn_dim (every Mixtral layer is MoE)"
    return None
