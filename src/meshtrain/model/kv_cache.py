"""Incremental decoding: the Llama forward with a key/value cache, for many sequences at once.

The cache holds, per layer, keys and values for `slots` sequences of up to `max_len` tokens. A
forward takes new tokens of some slots at given positions, writes their keys and values into those
slots and attends over each slot's cache up to its own position, so a batch can mix sequences of
different lengths (continuous batching): a prompt is one forward of its tokens (prefill), each
later token one row of a batched forward (decode). Same weights and modules as training; only the
attention reads its keys and values from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.model.llama import Llama


class KVCache:
    def __init__(self, model: Llama, slots: int, max_len: int, dtype: torch.dtype | None = None):
        args = model.args
        dtype = dtype or model.tok_embeddings.weight.dtype
        device = model.tok_embeddings.weight.device
        shape = (slots, args.n_kv_heads, max_len, args.head_size)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.max_len = max_len


def _attention(
    attn,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    batch, seq, _ = x.shape
    q, k, v = attn.project(x, cos, sin)
    rows = slots[:, None].expand(batch, seq)
    k_cache[rows, :, positions] = k.to(k_cache.dtype)  # (batch, seq, kv_heads, head_dim) into each slot
    v_cache[rows, :, positions] = v.to(v_cache.dtype)
    length = int(positions.max()) + 1
    keys, values = k_cache[slots, :, :length], v_cache[slots, :, :length]
    # Causal within the cache: a query at position p sees the keys at positions <= p of its own slot.
    mask = torch.arange(length, device=x.device)[None, None, None, :] <= positions[:, None, :, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, enable_gqa=True
    )
    return attn.wo(out.transpose(1, 2).reshape(batch, seq, -1))


@torch.inference_mode()
def forward_cached(
    model: Llama,
    cache: KVCache,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    every_position: bool = False,
) -> torch.Tensor:
    """tokens and positions (batch, seq) of the sequences in cache `slots` (batch,) -> logits of the
    last token of each row (batch, vocab), or with every_position of every token (batch, seq, vocab);
    padding rows of the vocabulary dropped."""
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        h = h + _attention(layer.attention, layer.attention_norm(h), cos, sin, cache.k[i], cache.v[i], slots, positions)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h if every_position else h[:, -1]))[..., : model.args.vocab_size]
