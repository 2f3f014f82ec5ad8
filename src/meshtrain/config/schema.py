"""The config tree: one dataclass per section. Each field is declared once: its annotation is its
type, `option(...)` its bounds and grammar, the string under it its `meshtrain train --help` line; the
loader, the CLI and jobscript all check values against that declaration (config/options.py). It reads
only the model's shape (ModelArgs, the presets) from model/; checks across keys live in checks.py."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from meshtrain.config.checks import check_across_keys
from meshtrain.config.grammar import parse_data_path, parse_duration
from meshtrain.config.options import declared, option
from meshtrain.model.args import MAX_POSITIONS, ModelArgs
from meshtrain.model.presets import PRESETS

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank; the others hold several
LAUNCHERS = ("auto", "torchrun", "azureml", "openmpi", "mpich", "slurm", "single")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICES = ("auto", "cpu", "cuda", "neuron")


DEFAULT_PRESET = "tiny"  # the shape of an unset model.preset


def check_preset(name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"unknown preset: use one of {', '.join(PRESETS)}")


def check_init_from(value: str) -> None:
    if value and not (value.startswith("hf:") and Path(value[3:], "config.json").is_file()):
        raise ValueError('use "hf:DIR" with a local Hugging Face model directory (config.json + safetensors)')


@dataclass
class ModelConfig:
    preset: str | None = option(None, check=check_preset, flags=("--model",))
    """Named shape (unset: tiny): tiny, small, gpt2-124m, gpt2-345m, llama3-8b/70b/405b,
    llama3.1-8b/70b/405b, llama3.2-1b/3b, mistral-7b, qwen2.5-7b/72b, qwen3-8b/32b; mixtures of experts
    tiny-moe, small-moe, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b. Refused beside
    model.init_from, whose config.json is the shape."""
    dim: int | None = option(None, gt=0, flags=("--hidden",))
    """Hidden size (unset: the preset's)."""
    n_layers: int | None = option(None, gt=0, flags=("--layers",))
    """Transformer blocks (unset: the preset's)."""
    n_heads: int | None = option(None, gt=0, flags=("--heads",))
    """Attention heads (unset: the preset's)."""
    n_kv_heads: int | None = option(None, gt=0, flags=("--kv-heads",))
    """Key/value heads for grouped-query attention (unset: the preset's)."""
    ffn_dim: int | None = option(None, gt=0, flags=("--ffn",))
    """SwiGLU hidden size (unset: the preset's)."""
    vocab_size: int | None = option(None, gt=0, flags=("--vocab",))
    """Vocabulary (unset: the prepared data's)."""
    max_seq_len: int | None = option(None, gt=0, le=MAX_POSITIONS)
    """Longest sequence the rotary tables cover (unset: the preset's)."""
    rope_theta: float | None = option(None, gt=0)
    """Rotary base (unset: the preset's)."""
    norm_eps: float | None = option(None, gt=0)
    """RMSNorm epsilon (unset: the preset's)."""
    tie_embeddings: bool | None = None
    """Share the embedding and output matrices (unset: the preset's)."""
    head_dim: int | None = option(None, gt=0)
    """Per-head dimension when it is not model.dim / model.n_heads (unset: the preset's)."""
    qkv_bias: bool | None = None
    """Biases on the query/key/value projections, as Qwen2 (unset: the preset's)."""
    qk_norm: bool | None = None
    """RMSNorm over each query and key head before the rotation, as Qwen3 (unset: the preset's)."""
    family: Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "meshtrain"] | None = None
    """The Hugging Face model_type `meshtrain export` writes (unset: the preset's); checked at the
    start against the architecture options (qwen2: qkv_bias; qwen3: qk_norm; qwen3_moe, mixtral:
    n_experts). "meshtrain": any options (DeepSeek-style routing), and no Hugging Face export."""
    n_experts: int | None = option(None, ge=0)
    """Routed experts of each MoE layer; 0: a dense model (unset: the preset's)."""
    top_k: int | None = option(None, gt=0)
    """Experts each token goes to (unset: the preset's)."""
    moe_ffn_dim: int | None = option(None, gt=0)
    """Each expert's SwiGLU hidden size (unset: the preset's, else model.ffn_dim)."""
    n_shared_experts: int | None = option(None, ge=0)
    """Experts every token goes through beside its routed ones, as DeepSeek (unset: the preset's)."""
    router_score: Literal["softmax", "sigmoid"] | None = None
    """The router's expert scores: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)."""
    norm_topk: bool | None = None
    """Renormalise a token's top-k weights to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    expert_groups: int | None = option(None, gt=0)
    """Experts split into this many groups; a token picks from its best model.groups_kept (DeepSeek-V3)."""
    groups_kept: int | None = option(None, gt=0)
    """The groups a token's experts come from (unset: every group)."""
    capacity_factor: float | None = option(None, ge=0)
    """0: dropless (every token reaches its experts). c > 0: in training an expert takes at most
    c x tokens x top_k / n_experts tokens, the earliest; the rest skip it and are counted as dropped."""
    moe_every: int | None = option(None, gt=0)
    """Layer i is an MoE layer where (i + 1) % moe_every == 0 (Qwen-MoE's decoder_sparse_step)."""
    first_dense: int | None = option(None, ge=0)
    """The first k layers keep a dense MLP (DeepSeek's first_k_dense_replace)."""
    load_balance: Literal["aux_loss", "bias", "none"] | None = None
    """aux_loss: Switch/GShard's auxiliary loss (model.aux_loss_coef); bias: DeepSeek-V3's
    aux-loss-free per-expert bias on the routing, moved once per optimizer step; none."""
    aux_loss_coef: float | None = option(None, ge=0)
    """The auxiliary loss's weight (router_aux_loss_coef; unset: the model's, 0.001)."""
    bias_update_rate: float | None = option(None, gt=0)
    """How far the aux-loss-free bias moves per optimizer step (DeepSeek-V3: 0.001)."""
    vocab_multiple: int | None = option(None, gt=0)
    """Pad embedding/output rows to a multiple of this (Megatron's make-vocab-size-divisible-by); a
    multiple of parallel.tp; stripped on export."""
    init_from: str = option("", check=check_init_from)
    """"hf:DIR": start from a local Hugging Face directory (Llama, Mistral, Qwen2/2.5, Qwen3): its
    config.json replaces the preset and the shape keys (only max_seq_len and vocab_multiple may be set)."""

    def source(self) -> str:
        """Where the shape comes from, for the start line: the pretrained directory or the preset."""
        return self.init_from or self.preset or DEFAULT_PRESET


@dataclass
class DataConfig:
    path: str = option("data/stdlib", check=lambda text: parse_data_path(text))
    """A directory written by `meshtrain data prepare`."""
    corpus: Literal["stdlib", ""] = "stdlib"
    """When `path` holds no prepared data: "stdlib" builds it from the Python standard library's source
    (on every machine); "" never builds (an error instead)."""
    vocab_size: int | None = option(None, ge=256)
    """BPE vocabulary trained for `corpus` (unset: 8192). Set, it must be the prepared data's
    vocabulary: data prepared with another one is refused, not silently used."""


def _off_or_at_least(value: float, least: float, unit: str) -> None:
    if value != 0 and value < least:
        raise ValueError(f"must be 0 (off) or at least {least} {unit}")


@dataclass
class TrainingConfig:
    steps: int = option(100, gt=0)
    """Optimizer steps of the schedule."""
    global_batch_size: int = option(16, gt=0, flags=("--global-batch",))
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = option(8, gt=0, flags=("--micro-batch",))
    """Sequences per forward/backward on one rank (gradient accumulation or pipeline micro-batches)."""
    seq_len: int = option(256, gt=0, flags=("--seq-len",))
    """Tokens per sequence."""
    lr: float = option(1e-3, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = option(0.1, ge=0, le=1)
    """The cosine decays to lr x this."""
    warmup_steps: int = option(10, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = option(0.1, ge=0)
    """AdamW weight decay (not on norms)."""
    beta1: float = option(0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = option(0.95, ge=0, lt=1)
    """AdamW beta2."""
    grad_clip: float = option(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    seed: int = option(0, ge=0, lt=2**63)
    """Seed of the weights and the data order."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option("auto", flags=("--dtype",))
    """Training precision: fp32; bf16 mixed precision (fp32 master weights and optimizer states); fp16
    mixed precision with dynamic loss scaling (for GPUs without bf16 units, such as the V100: a step
    whose gradients overflow is skipped and the scale halved); or "auto": bf16 where the device runs
    the step faster in it (a GPU with bf16 units; on a CPU, as measured at this model's shapes, see
    bf16_compute), fp32 otherwise. The choice and its measurement are logged at start and written to
    <run.dir>/arithmetic.json."""
    bf16_compute: Literal["auto", "bf16", "fp32", "bf16-gemm", "bf16-attention"] = "auto"
    """With bf16 storage, the arithmetic of each class of work: "bf16" kernels for the GEMMs and
    attention, "fp32" arithmetic on bf16-rounded inputs for both (same storage and numbers; faster where
    bf16 kernels are slow), "bf16-gemm" (bf16 GEMMs, fp32 attention) or "bf16-attention" (fp32 GEMMs,
    bf16 attention); "auto": bf16 on a GPU, and on a CPU whichever a probe times fastest, forward and
    backward at this model's shapes (cached per CPU model, thread count, torch version and shape).
    Setting it to anything but auto implies bf16 storage: refused with dtype fp32."""
    attention_backward: Literal["auto", "flash", "recompute"] = "auto"
    """How attention's gradients are computed on a CPU (causal, and document masks as a compiled step
    applies them): "flash", torch's flash-attention backward kernel; "recompute", the scores
    recomputed from matmuls (faster at short sequences when compiled, holding one layer's batch x
    heads x seq^2 fp32 scores, up to 256 MiB; beyond that the kernel); "auto": on a CPU with
    training.compile, whichever a probe times faster at this run's shapes in its attention arithmetic
    (cached like bf16_compute's), else flash. GPUs keep their attention kernels: "recompute" is
    refused there."""
    initial_loss_scale: float | None = option(None, ge=1)
    """With dtype fp16: the loss scale of the first step (unset: 65536, torch's GradScaler default)."""
    loss_scale_window: int | None = option(None, gt=0)
    """With dtype fp16: steps without overflow after which the loss scale doubles (unset: 2000)."""
    fp8: Literal["off", "tensorwise", "rowwise"] = option("off", flags=("--fp8",))
    """FP8 GEMMs in the blocks' linears (torchao float8 training; the embedding and output stay in
    the training dtype): "tensorwise" (one scale per tensor; its all-gather under ZeRO-3 is in fp8)
    or "rowwise" (a scale per row: more accurate, slower). On a GPU it needs FP8 units (compute
    capability 8.9: Ada, Hopper and later); on a CPU it runs emulated (same numbers, no speed-up),
    for tests."""
    activation_checkpointing: Literal["none", "full", "selective", "op"] = option("none", flags=("--ac",))
    """Recompute activations in backward: "full" every block, "selective" every ac_every-th block, "op"
    (torchtitan's op-level selective checkpointing) every block but keeping the matmul, attention and
    collective outputs, so only the cheap memory-bound ops (norms, rotary, SwiGLU, casts) rerun."""
    ac_every: int = option(2, gt=0)
    """With selective checkpointing: checkpoint every this many blocks."""
    document_masking: bool = True
    """Packed sequences as separate documents: attention never crosses an end-of-text token and each
    document's positions restart at 0 (torchtitan's and Megatron's document masking). Chat data: each
    conversation alone (and the padding), whatever end-of-text tokens its turns hold. Preference (DPO)
    data holds one conversation a row: false is refused there. Plain text whose tokenizer has no end-of-text
    token trains causal over the whole sequence (logged). Kernels: FlexAttention block masks on CUDA;
    elsewhere causal SDPA on each document (rows of 2,048 tokens or more, eager) or SDPA with a boolean
    mask (shorter rows, very many documents, compiled); a batch without any boundary runs plain causal
    attention (model/masks.py). Off:
    causal attention across the packed documents at positions 0..seq_len-1."""
    compile: bool = option(False, flags=("--compile",))
    """torch.compile the model (whole on one process or under TP, per block with DP/FSDP/PP) and the
    loss; the first step pays the compile."""
    cuda_graphs: bool = option(False, flags=("--cuda-graphs",))
    """With training.compile on one GPU: replay the compiled model's forward and backward as CUDA graphs
    (torch.compile's "reduce-overhead"), one launch each where the host would launch hundreds of
    kernels: for a model too small to keep a GPU busy, whose step waits on those launches
    (bench/README.md, "One GPU"). For one process without tensor, pipeline or data parallelism (the
    whole-model graph); refused elsewhere and off CUDA. The graphs hold their activations in a pool of
    their own, and a batch of another shape records another graph."""
    eval_every: int = option(50, ge=0)
    """Steps between validation passes; 0 = only at the end."""
    eval_batches: int = option(4, gt=0)
    """Global batches of validation data per pass, at most one pass over the split (named at start)."""
    peak_tflops: float = option(0.0, ge=0, flags=("--peak-tflops",))
    """Per-device peak for MFU; 0 = look up the GPU or measure the CPU."""
    stop_at_step: int = option(0, ge=0)
    """Checkpoint and exit 0 after this step (a long schedule as a chain of jobs); 0: run to the end."""
    time_limit: str = option("", check=lambda text: parse_duration(text, "training.time_limit"))
    """Wall-clock budget, "HH:MM:SS" or seconds (Slurm --time, ABCI h_rt): checkpoint and exit 75 (not done:
    run again; the generated SGE/Slurm scripts requeue) before it."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A NaN/Inf loss or gradient norm: skip the update, or stop with an error. Under fp16 an overflow
    always skips the step (and lowers the loss scale); "stop" stops once the scale is below 1."""
    objective: Literal["lm", "dpo"] = option("lm", flags=("--objective",))
    """What the loss learns: "lm", next-token cross-entropy (plain text, or chat data's answers); "dpo",
    Direct Preference Optimization (Rafailov et al. 2023) on data prepared with --format preference, against
    the frozen base as the reference (with LoRA: the same weights, adapters off). With dpo the batch sizes
    count preference pairs (each two sequences)."""
    dpo_beta: float | None = option(None, gt=0)
    """With objective dpo: the strength of the KL penalty towards the reference (unset: 0.1, TRL's default)."""
    hang_timeout: float = option(300.0, check=lambda v: _off_or_at_least(v, 5, "seconds"))
    """Seconds a rank may spend in one phase of a step (data, forward/backward, optimizer, evaluation,
    checkpoint; the first step 5x) before the job counts as hung: every live rank writes its stacks to
    <run.dir>/hangs/, the ranks that did not arrive are named, and the job exits 124 to continue from the
    last checkpoint (docs/launching.md). A checkpoint save or load has no limit while some rank's moves
    bytes: the job is hung once none has for this long. 0: off."""
    first_step_timeout: float | None = option(None, ge=5)
    """Seconds the first step may take (the data loader's start-up, compilation, warm-up) before the job counts
    as hung (unset: 5x training.hang_timeout; with hang_timeout = 0 there is no watchdog)."""


@dataclass
class ParallelConfig:
    tp: int = option(1, gt=0, flags=("--tp",))
    """Tensor-parallel degree (within a node). DP = world / (tp x pp x cp)."""
    pp: int = option(1, gt=0, flags=("--pp",))
    """Pipeline-parallel degree."""
    cp: int = option(1, gt=0, flags=("--cp",))
    """Context-parallel degree: each sequence split into cp contiguous slices, one per rank, for
    sequences longer than one rank can hold. Attention gathers the whole sequence for a share of the
    heads by an all-to-all (DeepSpeed-Ulysses), so n_heads / tp must divide by cp (and n_kv_heads / tp
    by cp, or cp by it: key/value heads are then copied). Gradients average and ZeRO shards over
    dp x cp. DP = world / (tp x pp x cp)."""
    ep: int = option(1, gt=0, flags=("--ep",))
    """Expert-parallel degree of a mixture of experts: each MoE layer's experts split over ep ranks,
    which send each token to the rank holding its expert and back (all-to-all). The ep ranks are
    data-parallel ranks (torchtitan's rule: ep divides dp_shard x cp); the experts are replicated over
    the other dp x cp / ep ones. n_experts must divide by ep."""
    dp_replicate: int = option(1, gt=0, flags=("--dp-replicate",))
    """> 1 with zero 2/3: hybrid sharding, shard within groups of DP / dp_replicate and replicate across."""
    dp_shard: int = option(0, ge=0)
    """Ranks each parameter is sharded over (ZeRO-2/3; DDP replicas under zero 0/1); 0: the rest of the world,
    world / (tp x pp x dp_replicate) (torchtitan's -1); a set value must equal that."""
    zero: Literal[0, 1, 2, 3] = option(0, flags=("--zero",))
    """0: DDP; 1: + optimizer states sharded; 2: + gradients sharded (FSDP2); 3: + parameters sharded (FSDP2)."""
    sequence_parallel: bool = option(True, flags=("--sequence-parallel",))
    """With tp > 1: norms and residuals sharded along the sequence."""
    loss_parallel: bool = True
    """With tp > 1: cross-entropy on vocabulary-sharded logits."""
    pp_schedule: Literal[PP_SCHEDULES] = option("1f1b", flags=("--pp-schedule",))
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble or zbv."""
    pp_microbatches: int = option(0, ge=0)
    """0: derived, local batch / training.micro_batch_size (a set value must equal it)."""
    pp_virtual_stages: int = option(1, gt=0, flags=("--virtual-stages",))
    """Pipeline stages per rank (interleaved schedules need >= 2, zbv exactly 2)."""
    cpu_offload: bool = option(False, flags=("--cpu-offload",))
    """With zero 3: keep the parameter shards, their gradients and the optimizer states in host
    memory (FSDP2's CPUOffloadPolicy); the optimizer steps on the CPU. Fits a larger model on small
    GPUs at the price of PCIe traffic each step. Needs a GPU (on a CPU there is nowhere to offload)."""


def check_lora_targets(text: str) -> None:
    from meshtrain.model.args import parse_targets

    parse_targets(text)


@dataclass
class PeftConfig:
    method: Literal["none", "lora", "qlora"] = option("none", flags=("--peft",))
    """Parameter-efficient fine-tuning: "none" trains every weight; "lora" freezes the base and trains
    low-rank adapters B A beside the target linears (Hu et al. 2021); "qlora" also stores the frozen
    target weights in 4-bit NF4 (Dettmers et al. 2023) and computes in bf16."""
    rank: int | None = option(None, gt=0, flags=("--lora-rank",))
    """The adapters' rank r (unset: 8)."""
    alpha: float | None = option(None, gt=0, flags=("--lora-alpha",))
    """The adapters' scale is alpha / rank (unset: 2 x rank)."""
    dropout: float | None = option(None, ge=0, lt=1, flags=("--lora-dropout",))
    """Dropout on the adapters' input (unset: 0)."""
    targets: str | None = option(None, check=check_lora_targets, flags=("--lora-targets",))
    """The linears that get adapters: "all" (unset; "attention" for a mixture of experts, whose routed
    experts take none), "attention", "mlp", or a comma list of wq, wk, wv, wo, w1, w2, w3 (or their
    Hugging Face names q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj)."""


@dataclass
class CheckpointConfig:
    every: int = option(0, ge=0)
    """Steps between checkpoints (0: none, except on preemption and planned stops)."""
    keep: int = option(3, gt=0)
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
    device: Literal[DEVICES] = "auto"
    """"auto": CUDA (NCCL) where there is a GPU, else CPU (gloo); "cpu" forces the CPU on a GPU machine;
    "neuron": AWS Trainium through torch-neuronx's native device (not run by meshtrain's tests)."""


@dataclass
class RunConfig:
    dir: str = "runs/tiny"
    """Where metrics, TensorBoard events, the config as given (config.toml), what "auto" chose
    (arithmetic.json), checkpoints and the weights go."""
    log_every: int = option(10, gt=0)
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
    save_model_max_gb: float = option(8.0, gt=0)
    """Largest model whose full weights are gathered into one process at the end."""
    plan_check: bool = False
    """Log the planner's prediction (model-state bytes per rank, peak of a step) next to what this run
    measured."""
    sample_prompt: str = "def "
    """After training, rank 0 prints a continuation of this; "" to skip."""
    sample_tokens: int = option(48, gt=0)
    """Tokens in that sample."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "Config":
        """Check every value against its declaration, then the values against each other and the
        preset's shape (as load_config does); returns self."""
        for key, declared_key in config_keys().items():
            section, _, name = key.partition(".")
            declared_key.check(getattr(getattr(self, section), ALIASES.get(name, name)))
        check_across_keys(self)
        return self


ALIASES = {"async": "async_"}  # TOML keys that are Python keywords
SECTIONS = typing.get_type_hints(Config)


def section_of(name: str) -> str:
    """The section that declares a key name (names are unique across [parallel] and [training])."""
    return next(section for section, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)})


def config_keys() -> dict[str, Any]:
    """Every key as declared (config.options.Declared), by dotted name: the `meshtrain train --help`
    listing and the declarations the loader checks values against."""
    return {d.name: d for section, cls in SECTIONS.items() for d in declared(cls, f"{section}.").values()}


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
