"""Incremental decoding: the Llama forward over a paged key/value cache, for many sequences at once.

The cache is a pool of fixed-size blocks per layer (vLLM's PagedAttention layout): a sequence owns
a list of blocks (its block table), taken as its tokens arrive and given back when it ends, so
memory follows the tokens in use rather than the longest possible answer. A forward takes new
tokens of some sequences at given positions, writes their keys and values into each one's blocks
and attends over its own blocks up to its own position, so a batch mixes sequences of different
lengths (continuous batching) and a prompt can be computed in chunks.

Prefix caching: a full block is named by its tokens and the name of the block before it, so two
sequences that start with the same tokens (a shared system prompt, the n answers of one prompt, a
conversation's earlier turns) share those blocks instead of computing them again. A shared block is
never written (only a sequence's last, partial block is), and a named block nobody uses stays
cached until its memory is needed, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch
import torch.nn.functional as F

from meshtrain.model.llama import Llama


def kv_bytes_per_token(model: Llama, dtype: torch.dtype | None = None) -> int:
    """Keys and values of one token in every layer."""
    args = model.args
    itemsize = (dtype or model.tok_embeddings.weight.dtype).itemsize
    return 2 * args.n_layers * args.n_kv_heads * args.head_size * itemsize


class PagedKVCache:
    """The block pool and its allocator. A block is free, used (its reference count is the number of
    sequences holding it), or cached: named, unused, and evicted least recently used first."""

    def __init__(
        self,
        model: Llama,
        blocks: int,
        block_size: int,
        prefix_caching: bool = True,
        dtype: torch.dtype | None = None,
    ):
        args = model.args
        dtype = dtype or model.tok_embeddings.weight.dtype
        device = model.tok_embeddings.weight.device
        # (block, position in it, kv head, head dim): a gathered block table is one run of positions
        shape = (blocks, block_size, args.n_kv_heads, args.head_size)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        # where each layer gathers its rows' blocks, reused: a fresh tensor of that size a layer costs
        # page faults that take longer than the attention (4x on a CPU, measured)
        self._gathered = (torch.empty(0, *shape[1:], dtype=dtype, device=device),) * 2
        self.blocks, self.block_size, self.prefix_caching = blocks, block_size, prefix_caching
        self.refs = [0] * blocks
        self.free: deque[int] = deque(range(blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # named blocks nobody holds, oldest use first
        # (name of the previous block, this block's tokens) -> (block, this block's name): exact, no hash collisions
        self.named: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._names = 0

    def available(self) -> int:
        """Blocks that can be taken now: the free ones and the cached ones nobody holds."""
        return len(self.free) + len(self.cached)

    def used(self) -> int:
        return self.blocks - self.available()

    def allocate(self) -> int | None:
        """A block for one sequence, or None when every block is held."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.named[self.key_of.pop(block)]
        else:
            return None
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cached.pop(block)
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.cached[block] = None  # the most recently used end
                else:
                    self.free.append(block)

    def match(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """The cached blocks that hold `tokens`' longest prefix of full blocks, each shared with the
        caller: (blocks, their names)."""
        blocks, names = [], []
        if not self.prefix_caching:
            return blocks, names
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            hit = self.named.get((names[-1] if names else 0, tuple(tokens[start : start + size])))
            if hit is None:
                break
            self.share(hit[0])
            blocks.append(hit[0])
            names.append(hit[1])
        return blocks, names

    def name_full_blocks(self, tokens: list[int], blocks: list[int], names: list[int], computed: int) -> None:
        """Name the sequence's blocks that are full and computed (`tokens[:computed]` is in the
        cache), after the `names` it has; a block whose tokens another block already holds keeps the
        other's name (so later blocks chain on it) and is freed, not cached, when released."""
        if not self.prefix_caching:
            return
        size = self.block_size
        for i in range(len(names), computed // size):
            key = (names[-1] if names else 0, tuple(tokens[i * size : (i + 1) * size]))
            if key in self.named:
                names.append(self.named[key][1])
                continue
            self._names += 1
            self.named[key] = (blocks[i], self._names)
            self.key_of[blocks[i]] = key
            names.append(self._names)

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each row's blocks, in order: (batch, blocks x block_size, kv_heads,
        head_dim) each, in buffers the next layer overwrites."""
        rows = tables.numel()
        if self._gathered[0].shape[0] < rows:
            self._gathered = tuple(
                torch.empty(rows, *pool.shape[1:], dtype=pool.dtype, device=pool.device)
                for pool in (self.k[0], self.v[0])
            )
        keys, values = (
            torch.index_select(pool, 0, tables.flatten(), out=buffer[:rows]).view(tables.shape[0], -1, *pool.shape[2:])
            for pool, buffer in zip((self.k[layer], self.v[layer]), self._gathered, strict=True)
        )
        return keys, values

    def copy_block(self, source: int, target: int) -> None:
        for keys, values in zip(self.k, self.v, strict=True):
            keys[target] = keys[source]
            values[target] = values[source]


def _attention(
    attn,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    tables: torch.Tensor,
    written: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
) -> torch.Tensor:
    batch, seq, _ = x.shape
    q, k, v = attn.project(x, cos, sin)
    blocks, offsets = written
    cache.k[layer][blocks, offsets] = k.to(cache.k[layer].dtype)  # (batch, seq, kv_heads, head_dim) into their blocks
    cache.v[layer][blocks, offsets] = v.to(cache.v[layer].dtype)
    keys, values = cache.gather(layer, tables)
    # grouped-query attention without repeating the keys: each kv head's query heads (and positions)
    # as one run of queries, (batch, kv_heads, seq x group, head_dim)
    kv_heads, head_dim = keys.shape[2], keys.shape[3]
    group = q.shape[2] // kv_heads
    queries = (
        q.view(batch, seq, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, head_dim)
    )
    # causal over each row's own positions; the padding of a shorter table lies past them, masked too
    seen = positions.repeat_interleave(group, dim=1)
    mask = torch.arange(keys.shape[1], device=x.device)[None, None, :] <= seen[:, :, None]
    out = F.scaled_dot_product_attention(
        queries, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype), attn_mask=mask[:, None]
    )
    out = out.view(batch, kv_heads, seq, group, head_dim).permute(0, 2, 1, 3, 4)
    return attn.wo(out.reshape(batch, seq, -1))


@torch.inference_mode()
def forward_paged(
    model: Llama,
    cache: PagedKVCache,
    tokens: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    every_position: bool = False,
) -> torch.Tensor:
    """tokens and positions (batch, seq) of sequences whose block tables are `tables` (batch, blocks;
    a shorter table padded with any block) -> logits of the last token of each row (batch, vocab),
    or with every_position of every token (batch, seq, vocab); padding rows of the vocabulary dropped."""
    written = (tables.gather(1, positions // cache.block_size), positions % cache.block_size)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        h = h + _attention(layer.attention, layer.attention_norm(h), cos, sin, cache, i, tables, written, positions)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h if every_position else h[:, -1]))[..., : model.args.vocab_size]
