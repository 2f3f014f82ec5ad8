"""Named model shapes. The large ones are for planning and dry runs (and the shapes a Hugging Face
import of those models has), not for CPUs. The Llama 3.1+, Mistral and Qwen shapes are the
published config.json files' (RoPE scaling, biases, q/k norms, head dimension and all)."""

from __future__ import annotations

from meshtrain.model.args import ModelArgs

PRESETS: dict[str, ModelArgs] = {
    # ~8.9M parameters: the CPU default; trains visibly in a couple of minutes on 2 cores.
    "tiny": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=8192, max_seq_len=1024),
    # ~52M parameters.
    "small": ModelArgs(dim=640, n_layers=8, n_heads=10, n_kv_heads=5, ffn_dim=2048, vocab_size=8192, max_seq_len=2048),
    # GPT-2 sizes in Llama form: SwiGLU hidden chosen so the MLP has GPT-2's parameter count.
    "gpt2-124m": ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=2048,
        vocab_size=50304,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "gpt2-345m": ModelArgs(
        dim=1024,
        n_layers=24,
        n_heads=16,
        n_kv_heads=16,
        ffn_dim=2752,
        vocab_size=50304,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # Meta Llama 3 / 3.1 shapes (Dubey et al. 2024, table 3).
    "llama3-8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-405b": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama31(dim: int, n_layers: int, n_heads: int, ffn_dim: int, **more) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=more.pop("rope_scaling", LLAMA31_ROPE),
        **more,
    )


def _qwen(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, family: str, **more) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        rope_theta=1000000.0,
        norm_eps=more.pop("norm_eps", 1e-6),
        family=family,
        **({"qkv_bias": True} if family == "qwen2" else {"qk_norm": True, "head_dim": 128}),
        **more,
    )


LLAMA32_ROPE = {**LLAMA31_ROPE, "factor": 32.0}
PRESETS |= {
    # Meta Llama 3.1 (128K context through llama3 RoPE scaling) and 3.2 (tied embeddings).
    "llama3.1-8b": _llama31(4096, 32, 32, 14336),
    "llama3.1-70b": _llama31(8192, 80, 64, 28672),
    "llama3.1-405b": _llama31(16384, 126, 128, 53248),
    "llama3.2-1b": _llama31(2048, 16, 32, 8192, rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    "llama3.2-3b": _llama31(3072, 28, 24, 8192, rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    # Mistral 7B v0.3 (no sliding window, 32K vocabulary).
    "mistral-7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32768,
        max_seq_len=32768,
        rope_theta=1000000.0,
        family="mistral",
    ),
    # Qwen 2.5 (biases on q/k/v) and Qwen3 (q/k norms, head dimension 128).
    "qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, "qwen2", vocab_size=152064, max_seq_len=131072),
    "qwen2.5-72b": _qwen(8192, 80, 64, 8, 29568, "qwen2", vocab_size=152064, max_seq_len=131072, norm_eps=1e-5),
    "qwen3-8b": _qwen(4096, 36, 32, 8, 12288, "qwen3", vocab_size=151936, max_seq_len=40960),
    "qwen3-32b": _qwen(5120, 64, 64, 8, 25600, "qwen3", vocab_size=151936, max_seq_len=40960),
}

# Mixtures of experts (model/moe.py). The small ones train on a CPU beside tiny and small: 8 experts,
# 2 per token; the published ones are their config.json files' (Qwen3-MoE: 128 experts, 8 per token,
# top-k weights renormalised; Mixtral: 8 experts, 2 per token, in every layer).
_QWEN3_MOE = {"n_experts": 128, "top_k": 8, "norm_topk": True, "vocab_size": 151936, "max_seq_len": 40960}
PRESETS |= {
    "tiny-moe": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=768,
        vocab_size=8192,
        max_seq_len=1024,
        qk_norm=True,
        family="qwen3_moe",
        n_experts=8,
        top_k=2,
        moe_ffn_dim=192,
    ),
    "small-moe": ModelArgs(
        dim=640,
        n_layers=8,
        n_heads=10,
        n_kv_heads=5,
        ffn_dim=2048,
        vocab_size=8192,
        max_seq_len=2048,
        qk_norm=True,
        family="qwen3_moe",
        n_experts=8,
        top_k=2,
        moe_ffn_dim=512,
    ),
    "qwen3-30b-a3b": _qwen(2048, 48, 32, 4, 6144, "qwen3_moe", moe_ffn_dim=768, **_QWEN3_MOE),
    "qwen3-235b-a22b": _qwen(4096, 94, 64, 4, 12288, "qwen3_moe", moe_ffn_dim=1536, **_QWEN3_MOE),
    "mixtral-8x7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1000000.0,
        family="mixtral",
        n_experts=8,
        top_k=2,
    ),
}
