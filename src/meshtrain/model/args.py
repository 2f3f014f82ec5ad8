"""A model's shape and its LoRA adapters' settings: plain values, importable without torch (the config tree and the CLI
read and check them before any framework loads)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from meshtrain.fields import LARGEST_SIZE, number, whole

# The longest context a model may declare: its rotary tables (cos and sin per position, computed in
# float64) are built whole at start; 2^24 positions of a 128-wide head already take 16 GiB there.
MAX_POSITIONS = 1 << 24


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    # Rotary frequency scaling for long contexts, as Hugging Face's rope_parameters without the theta:
    # {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...}; None: plain RoPE.
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int | None = None  # per attention head; None: dim // n_heads (Qwen3 sets it apart)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2, Llama's attention_bias)
    out_bias: bool = False  # a bias on the attention output projection (Llama's attention_bias)
    mlp_bias: bool = False  # biases on the three MLP projections (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotation (Qwen3)
    family: str = "llama"  # the Hugging Face model_type: llama, mistral, qwen2, qwen3
    vocab_multiple: int = 64  # embedding rows padded to a multiple of this (tensor-parallel friendly)
    # Mixture of experts (model/moe.py). n_experts 0: every layer's feed-forward is dense.
    n_experts: int = 0
    top_k: int = 2  # experts per token
    moe_ffn_dim: int | None = None  # each expert's hidden size (None: ffn_dim, which dense layers keep)
    n_shared_experts: int = 0  # experts every token goes through (DeepSeek), unweighted
    router_score: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    norm_topk: bool = True  # the top-k weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    expert_groups: int = 1  # experts split in groups; a token's experts come from its best groups_kept ones
    groups_kept: int | None = None  # None: all groups
    capacity_factor: float = 0.0  # 0: dropless; c: an expert takes at most c x tokens x top_k / n_experts
    moe_every: int = 1  # layer i is MoE where (i + 1) % moe_every == 0 (Qwen-MoE's decoder_sparse_step)
    first_dense: int = 0  # the first k layers dense (DeepSeek's first_k_dense_replace)
    dense_layers: tuple[int, ...] = ()  # and these (Qwen3-MoE's mlp_only_layers)
    load_balance: str = "aux_loss"  # "aux_loss" (Switch/GShard), "bias" (DeepSeek-V3, aux-loss-free) or "none"
    aux_loss_coef: float = 0.001  # router_aux_loss_coef
    bias_update_rate: float = 0.001  # the aux-loss-free bias's step per optimizer step

    def __post_init__(self):
        self.dense_layers = tuple(self.dense_layers)  # (model.json and config files give lists)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.n_experts > 0
            and i >= self.first_dense
            and (i + 1) % self.moe_every == 0
            and i not in self.dense_layers
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def kept_groups(self) -> int:
        return self.groups_kept or self.expert_groups

    @property
    def head_size(self) -> int:
        """The head dimension: head_dim where set, dim / n_heads otherwise."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


# Our linears and their Hugging Face (and peft target_modules) names.
HF_NAMES = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
}
GROUPS = {"all": tuple(HF_NAMES), "attention": ("wq", "wk", "wv", "wo"), "mlp": ("w1", "w2", "w3")}


_SIZES = {"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "vocab_multiple", "top_k"}
_SIZES |= {"moe_every", "expert_groups"}
_COUNTS = {"n_experts", "n_shared_experts", "first_dense"}
_SIZES_OR_NONE = {"head_dim", "moe_ffn_dim", "groups_kept"}
_POSITIVE_NUMBERS = {"rope_theta", "norm_eps"}
_NUMBERS = {"capacity_factor", "aux_loss_coef", "bias_update_rate"}
_CHOICES = {"router_score": ("softmax", "sigmoid"), "load_balance": ("aux_loss", "bias", "none")}


def model_record_problem(record: dict) -> str | None:
    """What is wrong with a ModelArgs read back from a file (model.json, a checkpoint's
    train_state.json), or None: every field known, typed and within bounds, so that no
    nonsense shape reaches the model's construction."""
    names = {f.name for f in fields(ModelArgs)}
    required = {f.name for f in fields(ModelArgs) if f.default is MISSING and f.default_factory is MISSING}
    if unknown := sorted(set(record) - names):
        return f"unknown field {unknown[0]}"
    if missing := sorted(required - set(record)):
        return f"no {missing[0]}"

    for key, value in record.items():
        ok = (
            (key in _SIZES and whole(value, 1, LARGEST_SIZE))
            or (key in _COUNTS and whole(value, 0, LARGEST_SIZE))
            or (key in _SIZES_OR_NONE and (value is None or whole(value, 1, LARGEST_SIZE)))
            or (key == "max_seq_len" and whole(value, 1, MAX_POSITIONS))
            or (key in _POSITIVE_NUMBERS and number(value, above=True))
            or (key in _NUMBERS and number(value))
            or (key in _CHOICES and value in _CHOICES[key])
            or (key == "family" and isinstance(value, str))
            or (key == "rope_scaling" and (value is None or isinstance(value, dict)))
            or (
                key == "dense_layers"
                and isinstance(value, list | tuple)
                and all(whole(i, 0, LARGEST_SIZE) for i in value)
            )
            or (type(value) is bool and key in {"tie_embeddings", "qkv_bias", "out_bias", "mlp_bias", "qk_norm"})
            or (type(value) is bool and key == "norm_topk")
        )
        if not ok:
            return f"{key} is {value!r}"
    return None


def parse_targets(text: str | None) -> tuple[str, ...]:
    """ "all", "attention", "mlp", or a comma list of our or Hugging Face linear names -> our names."""
    text = (text or "all").strip()
    if text in GROUPS:
        return GROUPS[text]
    from_hf = {hf: ours for ours, hf in HF_NAMES.items()}
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [n for n in names if n not in HF_NAMES and n not in from_hf]
    if unknown or not names:
        raise ValueError(
            f"{', '.join(unknown) or 'nothing'} is not a linear of the model: use all, attention, mlp, or a comma "
            f"list of {', '.join(HF_NAMES)} (or {', '.join(HF_NAMES.values())})"
        )
    ours = {from_hf.get(n, n) for n in names}
    return tuple(n for n in HF_NAMES if n in ours)


@dataclass(frozen=True)
class LoraSpec:
    """[peft] with its defaults resolved (rank 8, alpha 2 x rank, no dropout, every linear: job/model.py)."""

    method: str  # "lora" or "qlora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = GROUPS["all"]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def quantized(self) -> bool:
        return self.method == "qlora"

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
        }

    @classmethod
    def from_dict(cls, d: dict) -> LoraSpec:
        return cls(d["method"], d["rank"], d["alpha"], d["dropout"], tuple(d["targets"]))
