"""Named model shapes. The large ones are for planning and Hugging Face conversion, not for CPUs."""

from __future__ import annotations

from meshtrain.model.llama import ModelArgs

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
