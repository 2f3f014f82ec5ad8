"""The model's shape facts, kept beside the model (as torchtitan keeps its model args): every
parameter tensor with its shape, where it lives (the embedding stage, a block, the output stage) and
which dimension tensor parallelism splits; and the FLOPs of a token. The trainer's TP plan, its MFU and
the planner all read them. Two architectures: the Llama meshtrain trains, and classic GPT (LayerNorm,
GELU MLP of 4h, learned positions, tied embeddings) for planning published GPT runs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshtrain.model.args import ModelArgs

ARCHS = ("llama", "gpt")

# The dimension of each weight that tensor parallelism splits (parallel/tensor_parallel.py applies it,
# the planner counts bytes from it): column-parallel layers split their output features (dim 0),
# row-parallel ones their input features (dim 1), the embedding its vocabulary rows. Norm weights are
# replicated.
COLUMN, ROW = 0, 1
BLOCK_SHARDED_DIM = {
    "attention.wq": COLUMN,
    "attention.wk": COLUMN,
    "attention.wv": COLUMN,
    "attention.wo": ROW,
    "feed_forward.w1": COLUMN,
    "feed_forward.w2": ROW,
    "feed_forward.w3": COLUMN,
}
SHARDED_DIM = {
    "tok_embeddings.weight": 0,
    "output.weight": COLUMN,
    **{f"{name}.weight": dim for name, dim in BLOCK_SHARDED_DIM.items()},
    # a column-parallel layer's bias is split with its output features; a row-parallel one's is whole
    **{f"{name}.bias": 0 for name, dim in BLOCK_SHARDED_DIM.items() if dim == COLUMN},
}


def swiglu_weights(dim: int, hidden: int) -> list[tuple[str, tuple[int, int]]]:
    """A SwiGLU MLP's three weights: (name, (out, in))."""
    return [("w1", (hidden, dim)), ("w2", (dim, hidden)), ("w3", (hidden, dim))]


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    owner: str | int  # "embed" (first stage), "head" (last stage) or the block index
    tp_dim: int | None  # split by tensor parallelism along this dimension; None: replicated

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Shape:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int  # padded
    max_seq_len: int
    tie_embeddings: bool
    head_dim: int
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # mixture of experts: the routed experts, each token's count of them, an expert's hidden size, the
    # shared experts (each of expert_ffn_dim) and which layers have them (model/moe.py)
    n_experts: int = 0
    top_k: int = 0
    expert_ffn_dim: int = 0
    n_shared_experts: int = 0
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_args(cls, args: ModelArgs) -> "Shape":
        return cls(
            "llama",
            args.dim,
            args.n_layers,
            args.n_heads,
            args.n_kv_heads,
            args.ffn_dim,
            args.padded_vocab_size,
            args.max_seq_len,
            args.tie_embeddings,
            args.head_size,
            args.qkv_bias,
            args.out_bias,
            args.mlp_bias,
            args.qk_norm,
            args.n_experts,
            args.top_k if args.n_experts else 0,
            args.expert_ffn_dim if args.n_experts else 0,
            args.n_shared_experts if args.n_experts else 0,
            args.moe_layers,
        )

    @classmethod
    def gpt(cls, dim: int, n_layers: int, n_heads: int, vocab_size: int, max_seq_len: int) -> "Shape":
        return cls("gpt", dim, n_layers, n_heads, n_heads, 4 * dim, vocab_size, max_seq_len, True, dim // n_heads)

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): n_heads x head_dim, dim unless the
        head dimension is set apart (Qwen3-32B: 64 x 128 on a 5120-wide model)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def parameters(self) -> tuple[Param, ...]:
        """Every parameter tensor in the order the model defines them (a tied output is the embedding)."""
        return _parameters(self)

    def _llama(self) -> list[Param]:
        h, q, kv, f = self.dim, self.q_dim, self.kv_dim, self.ffn_dim

        def p(name, shape, owner):
            return Param(
                name, shape, owner, SHARDED_DIM.get(name.split(".", 2)[-1] if isinstance(owner, int) else name)
            )

        params = [p("tok_embeddings.weight", (self.vocab_size, h), "embed")]
        for i in range(self.n_layers):
            pre = f"layers.{i}."
            attention = [("wq", q, h), ("wk", kv, h), ("wv", kv, h), ("wo", h, q)]
            params.append(p(pre + "attention_norm.weight", (h,), i))
            for name, rows, cols in attention:
                params.append(p(pre + f"attention.{name}.weight", (rows, cols), i))
                if self.out_bias if name == "wo" else self.qkv_bias:
                    params.append(p(pre + f"attention.{name}.bias", (rows,), i))
            if self.qk_norm:
                params += [p(pre + "attention.q_norm.weight", (self.head_dim,), i)]
                params += [p(pre + "attention.k_norm.weight", (self.head_dim,), i)]
            params.append(p(pre + "ffn_norm.weight", (h,), i))
            if i in self.moe_layers:
                params += self._moe(pre + "feed_forward.", i)
                continue
            for name, (rows, cols) in swiglu_weights(h, f):
                params.append(p(pre + f"feed_forward.{name}.weight", (rows, cols), i))
                if self.mlp_bias:
                    params.append(p(pre + f"feed_forward.{name}.bias", (rows,), i))
        params.append(p("norm.weight", (h,), "head"))
        if not self.tie_embeddings:
            params.append(p("output.weight", (self.vocab_size, h), "head"))
        return params

    def _moe(self, pre: str, i: int) -> list[Param]:
        """An MoE layer's router, 3-D experts (expert, out, in) and shared experts' SwiGLU."""
        h, e, f = self.dim, self.n_experts, self.expert_ffn_dim
        params = [
            Param(pre + "router.weight", (e, h), i, None),
            Param(pre + "experts.w1", (e, f, h), i, None),
            Param(pre + "experts.w2", (e, h, f), i, None),
            Param(pre + "experts.w3", (e, f, h), i, None),
        ]
        if shared := self.n_shared_experts * f:
            params += [
                Param(pre + f"shared.{name}.weight", shape, i, None) for name, shape in swiglu_weights(h, shared)
            ]
        return params

    def active_numel(self, param: Param) -> int:
        """Of a parameter's values, those one token multiplies: top_k of n_experts of a routed expert's."""
        return param.numel * self.top_k // self.n_experts if ".experts." in param.name else param.numel

    def _gpt(self) -> list[Param]:
        """Megatron's GPT: fused QKV and fc1 split by columns (with their biases), proj and fc2 by rows."""
        h, f = self.dim, self.ffn_dim
        params = [
            Param("wte.weight", (self.vocab_size, h), "embed", 0),
            Param("wpe.weight", (self.max_seq_len, h), "embed", None),
        ]
        for i in range(self.n_layers):
            pre = f"h.{i}."
            params += [
                Param(pre + "ln_1.weight", (h,), i, None),
                Param(pre + "ln_1.bias", (h,), i, None),
                Param(pre + "attn.c_attn.weight", (3 * h, h), i, 0),
                Param(pre + "attn.c_attn.bias", (3 * h,), i, 0),
                Param(pre + "attn.c_proj.weight", (h, h), i, 1),
                Param(pre + "attn.c_proj.bias", (h,), i, None),
                Param(pre + "ln_2.weight", (h,), i, None),
                Param(pre + "ln_2.bias", (h,), i, None),
                Param(pre + "mlp.c_fc.weight", (f, h), i, 0),
                Param(pre + "mlp.c_fc.bias", (f,), i, 0),
                Param(pre + "mlp.c_proj.weight", (h, f), i, 1),
                Param(pre + "mlp.c_proj.bias", (h,), i, None),
            ]
        params += [Param("ln_f.weight", (h,), "head", None), Param("ln_f.bias", (h,), "head", None)]
        return params

    @functools.cache  # noqa: B019 (a frozen value object: cached by its fields, few shapes per process)
    def n_params(self) -> int:
        return sum(p.numel for p in self.parameters())

    @functools.cache  # noqa: B019 (a frozen value object: cached by its fields, few shapes per process)
    def flops_per_token(self, seq_len: int, lora=None, reference_forward: bool = False) -> float:
        """Model FLOPs of training one token: 6 x the parameters a token multiplies (no embedding
        lookup or positions) plus attention scores and weighted sum, 12 x layers x n_heads x head_dim x seq (PaLM
        appendix B; torchtitan's convention, no causal halving). MFU in the training log uses this too.
        `lora` (a LoraSpec): the frozen weights take no weight gradient, 4 x instead of 6 x, and the
        adapters 6 x theirs; `reference_forward` (DPO): one more forward, 2 x and the attention's third."""
        lookups = ("tok_embeddings.weight", "wte.weight", "wpe.weight")
        matmul = sum(self.active_numel(p) for p in self.parameters() if p.name not in lookups)
        if self.tie_embeddings:
            matmul += self.vocab_size * self.dim  # the output projection is the embedding matrix
        attention = 4.0 * self.n_layers * self.q_dim * seq_len  # forward; backward twice that
        flops = (4.0 if lora else 6.0) * matmul + 3 * attention
        if lora:
            from meshtrain.model.lora import adapter_count

            flops += 6.0 * adapter_count(self, lora)
        if reference_forward:
            flops += 2.0 * matmul + attention
        return flops


@functools.cache
def _parameters(shape: Shape) -> tuple[Param, ...]:
    return tuple(shape._llama() if shape.arch == "llama" else shape._gpt())
