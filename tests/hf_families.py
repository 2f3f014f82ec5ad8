"""Tiny random Hugging Face models of every family and config variant that changes the math, made
with transformers' own classes (shared by test_families.py and the multi-process worker)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,  # the test corpus tokenizer's
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# name: (transformers config class, fields beside BASE, dtype on disk, safetensors shards)
VARIANTS = {
    "llama2": ("LlamaConfig", {}, "float32", 1),
    "llama3.1": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}, "bfloat16", 2),
    "llama3.2-tied": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}, "float32", 1),
    "llama-linear-rope": ("LlamaConfig", {"rope_scaling": {"type": "linear", "factor": 4.0}}, "float32", 1),
    "llama-biases-head-dim": (
        "LlamaConfig",
        {"attention_bias": True, "mlp_bias": True, "head_dim": 32},
        "float32",
        1,
    ),
    "mistral": ("MistralConfig", {"sliding_window": None, "rope_theta": 1e6}, "float16", 1),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}, "float32", 2),
    "qwen2.5-yarn": (
        "Qwen2Config",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
        "bfloat16",
        1,
    ),
    "qwen3-tied": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, "float32", 1),
    "qwen3-bias": ("Qwen3Config", {"head_dim": 16, "attention_bias": True}, "float32", 1),
    # layer 0 a mixture of 8 experts (top 2, weights renormalised), layer 1 dense (mlp_only_layers)
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        | {"norm_topk_prob": True, "mlp_only_layers": [1]},
        "float32",
        2,
    ),
    # every second layer MoE (decoder_sparse_step), weights not renormalised
    "qwen3-moe-sparse-step": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 48, "decoder_sparse_step": 2},
        "bfloat16",
        1,
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
        "float32",
        1,
    ),
}


def make_model(name: str, out: Path, tokenizer: Path | None = None) -> Path:
    """A random model of the variant, every weight drawn (biases and norms too, which
    transformers initialises to constants), saved as transformers saves it."""
    import transformers

    cls, fields, dtype, shards = VARIANTS[name]
    config = getattr(transformers, cls)(**{**BASE, **fields})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape) if "norm" in param_name else 0.15 * torch.randn(p.shape))
    model = model.to(getattr(torch, dtype))
    # about half the model per file for a two-file checkpoint with an index
    size = sum(p.numel() * p.element_size() for p in model.parameters()) // shards + 2048
    model.save_pretrained(out, max_shard_size=size if shards > 1 else "5GB")
    if tokenizer is not None:
        shutil.copy(tokenizer, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(7))


def assert_close_logits(ours: torch.Tensor, theirs: torch.Tensor, min_scale: float = 1.0) -> None:
    """fp32 logits equal to within 1e-4 of their scale."""
    ours = ours[..., : theirs.shape[-1]]
    scale = theirs.abs().max().item()
    assert scale > min_scale  # weights that give the logits a spread
    assert (ours - theirs).abs().max().item() <= 1e-4 * scale
