"""meshtrain's parameters in Hugging Face's names and rotary layout, and back.

Names map one to one except for the rotary layout: meshtrain rotates adjacent pairs (x[2i],
x[2i+1]) as in the RoFormer paper and Meta's reference code, Hugging Face rotates halves
(x[i], x[i + d/2]); the q and k projections' output rows (and their biases, and Qwen3's per-head
norms) are permuted per head to match, which moves values without changing them. Padded vocabulary
rows (model.vocab_multiple) are stripped on export and re-added on import."""

from __future__ import annotations

import torch

from meshtrain.model.llama import Llama, ModelArgs

LAYER_NAMES = {
    **{
        f"attention.{ours}.{kind}": f"self_attn.{theirs}.{kind}"
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
        for kind in ("weight", "bias")
    },
    **{
        f"feed_forward.{ours}.{kind}": f"mlp.{theirs}.{kind}"
        for ours, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
        for kind in ("weight", "bias")
    },
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


SHORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # meshtrain's names -> config.json's


def pairs_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows (of a weight, a bias or a per-head norm) from interleaved pairs to
    rotate-half order."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).transpose(1, 2).reshape(rows, *rest)


def halves_to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, -1).transpose(1, 2).reshape(rows, *rest)


def rotary_heads(name: str, args: ModelArgs) -> int | None:
    """How many heads' rows a tensor holds in rotary order (None: no rotary rows)."""
    if ".wq." in name:
        return args.n_heads
    if ".wk." in name:
        return args.n_kv_heads
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 1
    return None


def to_hf_name(name: str) -> str:
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}.{LAYER_NAMES[rest]}"
    return {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }[name]


# An MoE layer's block in each family, and its experts' three projections (ours: w1 gate, w2 down, w3 up).
MOE_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
EXPERT_NAMES = {
    "qwen3_moe": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    "mixtral": {"w1": "w1", "w2": "w2", "w3": "w3"},
}


def to_hf_names(name: str, args: ModelArgs) -> list[str]:
    """The Hugging Face tensors one of ours is stored as: one, or one per expert for an MoE layer's
    3-D expert weight (expert e is row e of ours)."""
    if ".feed_forward.router." in name or ".feed_forward.experts." in name:
        _, i, _, kind, weight = name.split(".")  # layers.3.feed_forward.experts.w1
        block = f"model.layers.{i}.{MOE_BLOCK[args.family]}"
        if kind == "router":
            return [f"{block}.gate.weight"]
        theirs = EXPERT_NAMES[args.family][weight]
        return [f"{block}.experts.{e}.{theirs}.weight" for e in range(args.n_experts)]
    return [to_hf_name(name)]


def hf_state_dict(model: Llama, args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        if args.tie_embeddings and name == "output.weight":
            continue
        t = tensor.detach()
        if name in ("tok_embeddings.weight", "output.weight"):
            t = t[: args.vocab_size]  # strip the padding rows
        elif (heads := rotary_heads(name, args)) is not None:
            t = pairs_to_halves(t, heads)
        elif name.endswith("expert_bias"):
            continue  # routing state the families' configs have no place for (export refuses the bias)
        names = to_hf_names(name, args)
        for theirs, piece in zip(names, t.unbind(0) if len(names) > 1 else (t,), strict=True):
            out[theirs] = piece.to(dtype).contiguous().clone()
    return out
