"""The config tree: one dataclass per section, each field documented by the string under it (that
docstring is its `meshtrain train --help` line). It reads only the model's shape (ModelArgs, the
presets) from model/; the checks live in checks.py, reading in loading.py."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import tomli_w

from meshtrain.model.llama import ModelArgs
from meshtrain.model.presets import PRESETS

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank; the others hold several
LAUNCHERS = ("auto", "torchrun", "azureml", "openmpi", "mpich", "slurm", "single")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Named shape: tiny, small, gpt2-124m, gpt2-345m, llama3-8b, llama3-70b, llama3-405b."""
    dim: int | None = None
    """Hidden size (unset: the preset's)."""
    n_layers: int | None = None
    """Transformer blocks (unset: the preset's)."""
    n_heads: int | None = None
    """Attention heads (unset: the preset's)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (unset: the preset's)."""
    ffn_dim: int | None = None
    """SwiGLU hidden size (unset: the preset's)."""
    vocab_size: int | None = None
    """Vocabulary (unset: the prepared data's)."""
    max_seq_len: int | None = None
    """Longest sequence the rotary tables cover (unset: the preset's)."""
    rope_theta: float | None = None
    """Rotary base (unset: the preset's)."""
    norm_eps: float | None = None
    """RMSNorm epsilon (unset: the preset's)."""
    tie_embeddings: bool | None = None
    """Share the embedding and output matrices (unset: the preset's)."""
    vocab_multiple: int | None = None
    """Pad embedding/output rows to a multiple of this (Megatron's make-vocab-size-divisible-by); a
    multiple of parallel.tp; stripped on export."""
    init_from: str = ""
    """"hf:DIR": start from a local Hugging Face Llama directory (its config.json replaces the preset)."""


@dataclass
class DataConfig:
    path: str = "data/stdlib"
    """A directory written by `meshtrain data prepare`."""
    corpus: Literal["stdlib", ""] = "stdlib"
    """When `path` holds no prepared data: "stdlib" builds it from the Python standard library's source
    (on every machine); "" never builds (an error instead)."""
    vocab_size: int = 8192
    """BPE vocabulary trained for `corpus`."""


@dataclass
class TrainingConfig:
    steps: int = 100
    """Optimizer steps of the schedule."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank (gradient accumulation or pipeline micro-batches)."""
    seq_len: int = 256
    """Tokens per sequence."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr x this."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not on norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    seed: int = 0
    """Seed of the weights and the data order."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Training precision: fp32, or bf16 mixed precision (fp32 master weights and optimizer states)."""
    bf16_compute: Literal["auto", "bf16", "fp32"] = "auto"
    """With dtype bf16, the arithmetic of matmuls and attention: "bf16" kernels, or "fp32" on bf16-rounded
    inputs (same storage and numbers; faster where bf16 kernels are slow); "auto": on a CPU, whichever a
    probe (a GEMM and an attention backward in both, cached per CPU model and thread count) measured faster;
    bf16 on a GPU."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: "full" every block, "selective" every ac_every-th block."""
    ac_every: int = 2
    """With selective checkpointing: checkpoint every this many blocks."""
    compile: bool = False
    """torch.compile the model (whole on one process or under TP, per block with DP/FSDP/PP) and the
    loss; the first step pays the compile."""
    eval_every: int = 50
    """Steps between validation passes; 0 = only at the end."""
    eval_batches: int = 4
    """Global batches of validation data per pass."""
    peak_tflops: float = 0.0
    """Per-device peak for MFU; 0 = look up the GPU or measure the CPU."""
    stop_at_step: int = 0
    """Checkpoint and exit 0 after this step (a long schedule as a chain of jobs); 0: run to the end."""
    time_limit: str = ""
    """Wall-clock budget, "HH:MM:SS" or seconds (Slurm --time, ABCI h_rt): checkpoint and exit 75 (not done:
    run again; the generated SGE/Slurm scripts requeue) before it."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A NaN/Inf loss or gradient norm: skip the update, or stop with an error."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (within a node). DP = world / (tp x pp)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    dp_replicate: int = 1
    """> 1 with zero 2/3: hybrid sharding, shard within groups of DP / dp_replicate and replicate across."""
    zero: int = 0
    """0: DDP; 1: + optimizer states sharded; 2: + gradients sharded (FSDP2); 3: + parameters sharded (FSDP2)."""
    sequence_parallel: bool = True
    """With tp > 1: norms and residuals sharded along the sequence."""
    loss_parallel: bool = True
    """With tp > 1: cross-entropy on vocabulary-sharded logits."""
    pp_schedule: Literal[PP_SCHEDULES] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble or zbv."""
    pp_microbatches: int = 0
    """0: derived, local batch / training.micro_batch_size (a set value must equal it)."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved schedules need >= 2, zbv exactly 2)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints (0: none, except on preemption and planned stops)."""
    keep: int = 3
    """Committed checkpoints kept; older ones are deleted after a newer one commits."""
    async_: bool = False
    """TOML key `async`: DCP async save, training continues while it writes."""
    resume: str = "auto"
    """"auto": the latest committed checkpoint in dir, if any; "none"; or a path."""
    dir: str = ""
    """Default: <run.dir>/checkpoints."""


@dataclass
class LaunchConfig:
    env: Literal[LAUNCHERS] = "auto"
    """Who started the processes: "auto" detects torchrun, Slurm, Open MPI, MPICH, AzureML; or force one."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": CUDA (NCCL) where there is a GPU, else CPU (gloo); "cpu" forces the CPU on a GPU machine."""


@dataclass
class RunConfig:
    dir: str = "runs/tiny"
    """Where metrics, TensorBoard events, the resolved config, checkpoints and the weights go."""
    log_every: int = 10
    """Steps between logged metrics."""
    log_level: Literal[LOG_LEVELS] = "info"
    """Rank 0 prints at this level; other ranks print warnings and errors."""
    progress: bool = True
    """Rich progress bar on rank 0 (only drawn on a terminal)."""
    tensorboard: bool = True
    """Write TensorBoard events to <dir>/tb."""
    save_model: bool = True
    """At the end, write the weights to <dir>/model.safetensors (above save_model_max_gb: export the last
    checkpoint with `meshtrain export` instead)."""
    save_model_max_gb: float = 8.0
    """Largest model whose full weights are gathered into one process at the end."""
    plan_check: bool = False
    """Log the planner's prediction (model-state bytes per rank, peak of a step) next to what this run
    measured."""
    sample_prompt: str = "def "
    """After training, rank 0 prints a continuation of this; "" to skip."""
    sample_tokens: int = 48
    """Tokens in that sample."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "Config":
        """Check every single value and the preset's shape (as load_config does); returns self."""
        from meshtrain.config.checks import validate

        validate(self)
        return self

    def model_args(self, vocab_size: int | None = None, base: ModelArgs | None = None) -> ModelArgs:
        """`base` (default: the preset) with this config's overrides; `vocab_size` fills an unset one."""
        args = dataclasses.replace(base or PRESETS[self.model.preset])
        for f in dataclasses.fields(ModelArgs):
            value = getattr(self.model, f.name, None)
            if value is not None:
                setattr(args, f.name, value)
        if self.model.vocab_size is None and vocab_size is not None and base is None:
            args.vocab_size = vocab_size
        return args


ALIASES = {"async": "async_"}  # TOML keys that are Python keywords
SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def config_keys() -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, help) for every key: the `meshtrain train --help` listing."""
    inverse = {v: k for k, v in ALIASES.items()}
    keys = []
    for section, cls in typing.get_type_hints(Config).items():
        hints, docs, defaults = typing.get_type_hints(cls), field_docs(cls), cls()
        for f in dataclasses.fields(cls):
            keys.append(
                (
                    f"{section}.{inverse.get(f.name, f.name)}",
                    hints[f.name],
                    getattr(defaults, f.name),
                    docs.get(f.name, ""),
                )
            )
    return keys


def micro_batches(t: TrainingConfig, dp: int) -> int:
    """Micro-batches per step on one rank: accumulation steps, or the pipeline schedule's micro-batches."""
    return t.global_batch_size // (t.micro_batch_size * dp)


def to_toml(cfg: Config) -> str:
    inverse = {v: k for k, v in ALIASES.items()}

    def drop_none(d: dict) -> dict:
        return {inverse.get(k, k): drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

    return tomli_w.dumps(drop_none(dataclasses.asdict(cfg)))


def resolved(cfg: Config, args: ModelArgs) -> Config:
    """The config with the model's shape spelled out (what `<run.dir>/config.toml` holds)."""
    out = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    for f in dataclasses.fields(ModelArgs):
        setattr(out.model, f.name, getattr(args, f.name))
    return out
