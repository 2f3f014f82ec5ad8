"""Document masking: in a packed sequence each token attends only to the earlier tokens of its own
document, and its rotary position counts from its document's start (torchtitan's and Megatron's
`reset_attention_mask` / `reset_position_ids`).

A batch describes its documents by `positions` (batch, seq), each token's position within its
document: a document starts where positions == 0, so cumsum(positions == 0) numbers the documents of
a row. `DocumentMask` is built from them once per forward, over the whole sequence (context
parallelism hands attention the full sequence for a share of the heads, so it needs no other mask),
and every layer's attention core calls `attend(q, k, v)` with it:

- CUDA: FlexAttention with a block mask (only the blocks on the diagonal of each document are
  computed, so masking costs less than plain causal attention where documents are short);
- elsewhere (FlexAttention has no backward on a CPU in torch 2.13): SDPA with a boolean
  (batch, 1, seq, seq) mask, q and k in the same document and q >= k. On a 2-core Xeon its forward and
  backward cost 1.4-2x the causal kernel at 1k-4k tokens (bench/README.md).

A batch without any document boundary needs no mask: the loader hands it over with positions None,
which the model runs as plain causal attention over positions 0..seq-1.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """positions (batch, seq) -> the index of each token's document within its row (0, 1, ...;
    tokens before the first position 0 count as document 0 too)."""
    return (positions == 0).cumsum(dim=1)


def dense_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query q may attend to key k: same document and k <= q."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :]).logical_and(causal)[:, None]


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _flex(name: str):
    """FlexAttention's `create_block_mask` or `flex_attention`: compiled once here when called
    eagerly (eager FlexAttention materialises the whole score matrix), as it is when the caller is
    itself being compiled."""
    from torch.nn.attention import flex_attention as flex

    fn = getattr(flex, name)
    return fn if torch.compiler.is_compiling() else _compiled(fn)


def block_mask(documents: torch.Tensor):
    """A FlexAttention BlockMask of document-causal attention for (batch, seq) document ids."""

    def document_causal(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)

    batch, seq = documents.shape
    return _flex("create_block_mask")(document_causal, batch, None, seq, seq, device=documents.device)


def flex_available(device: torch.device) -> bool:
    """FlexAttention trains on CUDA (on a CPU it has no backward in torch 2.13)."""
    return device.type == "cuda"


class DocumentMask:
    """Which keys each query sees in a packed batch, built once per forward from `positions`
    (batch, seq) and handed to every attention layer. `flex`: use FlexAttention (default: on CUDA)."""

    def __init__(self, positions: torch.Tensor, flex: bool | None = None):
        self.positions = positions
        self.documents = document_ids(positions)
        self.flex = flex_available(positions.device) if flex is None else flex
        self.block_mask = block_mask(self.documents) if self.flex else None
        self.dense = None if self.flex else dense_mask(self.documents)

    @property
    def seq_len(self) -> int:
        return self.positions.shape[1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of (batch, heads, seq, head_dim) q, k, v over the whole sequence the mask
        describes; grouped-query k/v heads shared by their query groups without copies."""
        if q.shape[2] != self.seq_len or k.shape[2] != self.seq_len:
            raise ValueError(f"a document mask of {self.seq_len} tokens given q/k of {q.shape[2]}/{k.shape[2]}")
        if self.block_mask is not None:
            return _flex("flex_attention")(q, k, v, block_mask=self.block_mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense, enable_gqa=True)


def plain_positions(batch: int, seq: int, device: torch.device | None = None) -> torch.Tensor:
    """0..seq-1 in every row: the positions of a batch with no document boundary."""
    return torch.arange(seq, device=device).expand(batch, seq)
