"""A Llama-style decoder, written to read like the papers it comes from.

Token embedding -> N x [RMSNorm -> grouped-query attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output projection.

The families that share this skeleton are options of the one model, as in torchtitan's model args:
Llama 1-3.3 (rotary scaling, tied embeddings for 3.2's small sizes), Mistral, Qwen2/2.5 (biases on
the q/k/v projections) and Qwen3 (RMSNorm on each query and key head, a head dimension apart from
dim / n_heads); Mixtral and Qwen3-MoE are the same blocks with a mixture of experts in place of the
MLP (model/moe.py). `family` names the Hugging Face `model_type` an export writes back.

The module tree (`tok_embeddings`, `layers.{i}.attention.wq`, ...) follows torchtitan so that the
parallel plans and checkpoint names stay simple. `layers` is an `nn.ModuleDict` keyed by the layer
index, so a pipeline stage can drop the layers it does not own and keep every parameter's name.
The forward returns logits; the loss lives in the training loop (pipeline schedules and
vocabulary-parallel cross-entropy need it there).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import CheckpointError
from meshtrain.model.args import ModelArgs
from meshtrain.model.feed_forward import FeedForward
from meshtrain.model.masks import DocumentMask, flex_available
from meshtrain.model.moe import MoE
from meshtrain.model.recompute_attention import applies, recomputed_attention


def precompute_rope(args: ModelArgs, max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of position x frequency, RoFormer eq. 15: frequencies theta^(-2i/d) on pairs of dims,
    rescaled for long contexts as args.rope_scaling says (model/rope.py)."""
    from meshtrain.model.rope import rope_frequencies

    freqs, attention_factor = rope_frequencies(args.head_size, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(max_seq_len or args.max_seq_len, dtype=torch.float64), freqs)
    return (angles.cos() * attention_factor).float(), (angles.sin() * attention_factor).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) of every head by its position's angle.

    x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim / 2), or (batch, seq, head_dim / 2) when
    each sequence of the batch sits at its own positions (decoding with a KV cache).
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs.unbind(-1)
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention (GQA): n_kv_heads key/value heads shared by n_heads queries."""

    sequence_slice: tuple[int, int] = (0, 1)  # (this rank's slice, slices) under context parallelism
    # CPU: the flash kernel's forward with a backward recomputed from matmuls (model/recompute_attention.py),
    # set where training.attention_backward resolved to "recompute"
    recompute_backward: bool = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_size
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=args.out_bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        """x (batch, seq, dim); cos/sin the rotary table (positions, head_dim / 2), read from 0, or
        each token's own (batch, seq, head_dim / 2); `mask`: the batch's documents (None: causal)."""
        batch, seq, _ = x.shape  # the whole sequence (or this rank's context-parallel slice of it)
        # even when the blocks' inputs are sequence-sharded; cos/sin: from position 0 of the whole sequence
        start = self.sequence_slice[0] * seq
        if cos.ndim == 2:
            cos, sin = cos[start : start + seq], sin[start : start + seq]
        elif cos.shape[1] != seq:
            cos, sin = cos[:, start : start + seq], sin[:, start : start + seq]
        q, k, v = self.project(x, cos, sin)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries and keys (rotated) and values, (batch, seq, heads, head_dim) each."""
        batch, seq, _ = x.shape
        # -1 instead of the head counts: under tensor parallelism each rank holds a slice of heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask) v on (batch, heads, seq, head_dim); enable_gqa: the
        KV heads are shared by their query groups without copies. With a document `mask` (over the
        whole sequence of q, k and v) each query sees only the earlier keys of its own document."""
        if mask is not None:
            return mask.attend(q, k, v, self.recompute_backward)
        if self.recompute_backward and applies(q):
            return recomputed_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # a mixture of experts in the layers args.is_moe_layer picks (model/moe.py), SwiGLU elsewhere
        self.feed_forward = (
            MoE(args, index) if args.is_moe_layer(index) else FeedForward(args.dim, args.ffn_dim, args.mlp_bias)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        # the mask as a keyword: tensor parallelism's input plan lays out the positional inputs
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    sequence_slice: tuple[int, int] = (0, 1)  # (this rank's slice, slices) under context parallelism

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.padded_vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.padded_vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = precompute_rope(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab). A pipeline stage without the
        embedding takes hidden states instead, and one without the output returns them.

        `positions` (batch, seq) int64: each token's position within its document, 0 where a
        document starts (packed data, model/masks.py): rotary angles of those positions, and
        attention within each document only. None: positions 0..seq-1 and causal attention.

        Under context parallelism (parallel/context_parallel.py sets `sequence_slice` to (this
        rank's slice, slices)) `tokens` and `positions` are of the whole sequence: the rank embeds
        its contiguous slice and returns that slice's logits; attention gathers the rest."""
        mask = None
        if positions is not None and flex_available(positions.device):
            # FlexAttention's block mask is built here, eagerly, outside a compiled `trunk`
            # (built inside one whole-model graph it failed on a GPU: parallel/compile.py)
            mask = DocumentMask(positions)
        return self.trunk(tokens, positions, mask)

    def trunk(self, tokens: torch.Tensor, positions: torch.Tensor | None, mask: DocumentMask | None) -> torch.Tensor:
        """The forward once the attention mask is known (`mask`: a prebuilt one, or None to build it
        from `positions` here): what a whole-model compile compiles (parallel/compile.py)."""
        rank, ranks = self.sequence_slice
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens if ranks == 1 else tokens.chunk(ranks, dim=1)[rank])
        else:
            h = tokens  # a later pipeline stage: hidden states (of this rank's slice)
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:  # once per forward, for every layer, over the whole sequence
            cos, sin = cos[positions], sin[positions]
            mask = mask if mask is not None else DocumentMask(positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load full weights that meshtrain saved (a run's model.safetensors, the end-of-run state):
        every tensor of the model must be there and nothing else; only a tied output may be absent,
        being the embedding (a layer left out would otherwise keep its random initial weights)."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "output.weight" and self.args.tie_embeddings)]
        if missing or unexpected:
            raise CheckpointError(
                f"the saved weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}:"
                " they belong to another model shape (model.json) or the file is damaged"
            )
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None, draw: bool = True) -> None:
        """Deterministic initialisation that does not depend on the parallel layout.

        Every parameter is drawn in full on the CPU from a generator seeded by (seed, its name), then
        this rank keeps its own piece (a DTensor shard, a pipeline stage's layers). So a run on one
        process and a run on any mesh start from the same weights, whatever the order in which
        parameters are visited or which of them a rank holds. `draw` False sets the buffers only: a
        dry run's fake parameters hold no values (and sharding each full draw was half its time).
        """
        device = buffer_device or self.rope_cos.device
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty() re-creates, and so unties, them
        cos, sin = precompute_rope(self.args)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers(device)
        if not draw:
            return
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)  # GPT-2: scale residual outputs
        for wrapped_name, param in self.named_parameters():
            name = clean_fqn(wrapped_name)
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape)
            elif name.endswith(".bias"):
                full = torch.zeros(param.shape)
            elif name.endswith((".lora_a", ".lora_b")):
                from meshtrain.model.lora import init_adapter

                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                full = init_adapter(name, param.shape, gen)
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
                if name == "output.weight" and self.args.tie_embeddings:
                    name = "tok_embeddings.weight"  # a pipeline's last stage: its copy of the embedding
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                full = torch.randn(param.shape, generator=gen) * std
            copy_full_into(param, full)


def clean_fqn(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP, activation checkpointing, compile)."""
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into a parameter, which may be a DTensor shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameters of the full model (counts DTensors by their global shape; shared weights once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embedding and name.startswith("tok_embeddings")):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
