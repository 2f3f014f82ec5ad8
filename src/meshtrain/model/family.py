"""The families of dense decoders the one model covers, and what each family's architecture fixes:
its Hugging Face class name, which of the model's options it has (biases, q/k norms) and the
config.json fields it reads beside the common ones. A config naming a family is checked against
it before training, so a model that its family's format cannot express is refused at the start,
not at export."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.model.args import ModelArgs

SLIDING = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})


@dataclass(frozen=True)
class Family:
    architecture: str
    fields: frozenset[str]  # the family's own fields beside the common ones
    qkv_bias: bool | None = None  # fixed by the family (Qwen2: always); None: from attention_bias
    qk_norm: bool = False


FAMILIES = {
    "llama": Family("LlamaForCausalLM", frozenset({"attention_bias", "mlp_bias"})),
    "mistral": Family("MistralForCausalLM", frozenset({"sliding_window"})),
    "qwen2": Family("Qwen2ForCausalLM", SLIDING, qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", SLIDING | {"attention_bias"}, qk_norm=True),
}


def inexpressible(args: ModelArgs) -> str | None:
    """What of args the family's architecture has no place for (None: all of it fits)."""
    family = FAMILIES[args.family]
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
    return None
