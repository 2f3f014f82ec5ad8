"""A plan request resolved and planned: `meshtrain plan`'s options and config keys -> the model, the
GPUs, the device and its links, the arithmetic, the knobs the user pinned -> the layouts searched and
ranked (`make_plan`), and the best written as a training config (`write_best`). The same rules as the
trainer's where they overlap (a config's model and layout are resolved by job/); what only a plan can
get wrong (a --gpu against launch.device, GPT's block, the links) is refused here, in one line.

[peft], --objective dpo, fp16, FP8 and CPU offload (a layout knob that is never searched: off unless
given) are planned and written too. Context parallelism is searched over the powers of two that fit
the GPUs, the sequence and the heads, unless given. A layout key given on the command line (or every
one of them, with --config) pins that knob; the others are searched."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshtrain.config import (
    SHAPED_BY,
    Config,
    check_keys_in_force,
    config_keys,
    load_config,
    option,
    section_of,
    to_toml,
)
from meshtrain.errors import ConfigError, DataError, MeshtrainError
from meshtrain.job.model import adapters_of, resolve_model
from meshtrain.layout import Layout
from meshtrain.model import PRESETS, ModelArgs
from meshtrain.model.args import LoraSpec
from meshtrain.model.shapes import Shape
from meshtrain.plan.checks import check_compiled, check_cp, check_links, check_peak, check_peft, check_precision
from meshtrain.plan.failures import LLAMA3_RATE, JobTimes, compare
from meshtrain.plan.hardware import KINDS, Device, device
from meshtrain.plan.search import Estimate, schedule_refusal, search
from meshtrain.plan.workload import Workload


def failure_rate(text: str) -> float:
    """`llama3`, or failures per 1,000 GPUs per day."""
    if text.strip().lower() == "llama3":
        return LLAMA3_RATE
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a rate: give failures per 1,000 GPUs per day, or llama3") from None


PLAN_HEADER = "# a meshtrain training config written by `meshtrain plan --write-config`"
# The config keys plan reads (their short spellings are declared with them, config/schema.py).
PLAN_KEYS = (
    "model.preset",
    "model.n_layers",
    "model.dim",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_dim",
    "model.vocab_size",
    "model.max_seq_len",
    "training.seq_len",
    "training.global_batch_size",
    "training.dtype",
    "training.fp8",
    "training.compile",
    "training.cuda_graphs",
    "training.peak_tflops",
    "training.micro_batch_size",
    "training.activation_checkpointing",
    "training.ac_every",
    "parallel.tp",
    "parallel.pp",
    "parallel.cp",
    "parallel.zero",
    "parallel.dp_replicate",
    "parallel.pp_schedule",
    "parallel.pp_virtual_stages",
    "parallel.sequence_parallel",
    "parallel.loss_parallel",
    "parallel.cpu_offload",
    "training.objective",
    "peft.method",
    "peft.rank",
    "peft.alpha",
    "peft.dropout",
    "peft.targets",
)
COMPILE_KEYS = ("compile", "cuda_graphs")  # training keys plan takes from --config, else only when given
# The layout's knobs plan searches over (every Layout field but the resolved ones).
KNOBS = tuple(f.name for f in dataclasses.fields(Layout) if f.name not in ("dp_shard", "global_batch_size"))


@dataclass
class PlanOptions:
    gpu: Literal[KINDS] = option()
    """Device kind: one of the catalog's GPUs, or cpu (this machine, measured)."""
    config: str | None = None
    """Explain the layout of this training config (model, batch, [parallel]); not with --model."""
    gpus: int | None = option(None, ge=1)
    """GPUs (processes) in all (default: the world the --config sets, tp x pp x cp x dp_replicate x dp_shard, else
    8)."""
    gpus_per_node: int | None = option(None, ge=1)
    """Default: 8 (cpu: the --gpus processes on this machine)."""
    arch: Literal["llama", "gpt"] = "llama"
    """gpt: LayerNorm, GELU MLP of 4h, learned positions, tied embeddings (Megatron GPT)."""
    attention: Literal["flash", "math"] = "flash"
    """math: the s x s attention scores are saved (GPT runs without flash attention)."""
    network: str | None = None
    """Inter-node fabric: ib-edr, ib-hdr, ib-ndr, efa-p4d, efa-p5, roce-100g, ethernet-10g (default: the GPU's
    usual one)."""
    inter_node_gbps: float | None = option(None, gt=0)
    """Inter-node bus bandwidth per GPU, GB/s (bytes)."""
    intra_node_gbps: float | None = option(None, gt=0)
    """Intra-node bus bandwidth, GB/s (bytes)."""
    comm: list[str] = option(default_factory=list)
    """A `meshtrain bench comm --out FILE` file measured on your cluster (one node: intra-node; several:
    inter-node); repeatable."""
    memory_gib: float | None = option(None, gt=0)
    """Override the device memory."""
    host_memory_gib: float | None = option(None, gt=0)
    """Override the host memory of a node (GiB), which CPU offload fills with the model states."""
    efficiency: float | None = option(None, ge=0.01, le=1.0)
    """Sustained fraction of the peak in training matmuls (0.01 to 1)."""
    top: int | None = option(None, ge=1)
    """Layouts shown, best first (default: 10 in the table, all in --json)."""
    json: bool = False
    """Print JSON (a list `layouts`, best first; --top N: the first N)."""
    write_config: str | None = None
    """Write the best layout as a training config to this TOML file."""
    verify: int | None = option(None, ge=1, nargs="?", const=1)
    """Dry-run the best N layouts (default 1) at their world size (`train --dry-run`) and add what the built job
    holds on its busiest rank (`built`), beside the planner's figures for that rank and its kernels (`planned`)."""
    failures: float | None = option(None, parse=failure_rate, ge=1e-6, le=1000)
    """Replay failures at this rate, per 1,000 GPUs per day (`llama3`: 466 in 54 days on 16,384 GPUs, 0.53), with
    the best layout's step time: the effective training time of checkpoint-restart and of replica groups
    (torchft), each checkpointing at its Young/Daly interval."""
    failure_days: float | None = option(None, gt=0, le=3650)
    """--failures: the days replayed (default 54, Llama 3's snapshot)."""
    restart_s: float | None = option(None, ge=0, le=1e6)
    """--failures: seconds to relaunch the job or a group, before any state is read (default 600)."""
    storage_gbps: float | None = option(None, gt=0, le=1e6)
    """--failures: the file system's write and read bandwidth for checkpoints, GB/s in all (default 100)."""
    replica_groups: int | None = option(None, ge=2)
    """--failures: replica groups (default: the best layout's data-parallel degree; it must divide it)."""


def load_request(o: PlanOptions, overrides: list[str]) -> tuple[Config, set[str]]:
    """The config (a file, else the defaults) with the config-key flags, through the config loader;
    and the keys given on the command line. Two rules of sizing a model by flags: heads without
    key/value heads (on the command line or in the --config file) are multi-head attention, and the
    model covers the sequence it is planned for."""
    given = {overrides[i][2:] for i in range(0, len(overrides), 2)}
    if o.config and "model.preset" in given:
        raise MeshtrainError("plan: argument --config: not allowed with argument --model.preset/--model")
    preset = dict(zip(overrides[::2], overrides[1::2])).get("--model.preset")
    if preset is not None and preset not in PRESETS:
        hint = " (a config file is --config FILE)" if Path(preset).is_file() else ""
        raise MeshtrainError(f"--model.preset {preset!r} is not a preset: use one of {', '.join(PRESETS)}{hint}")
    values = dict(zip(overrides[::2], overrides[1::2]))
    # multi-head attention, as GPT sizes it, unless the flags or the --config file set key/value heads
    if "model.n_heads" in given and "model.n_kv_heads" not in given and not file_sets_kv_heads(o):
        overrides += ["--model.n_kv_heads", values["--model.n_heads"]]
    if values.get("--peft.method") == "qlora" and "training.dtype" not in given and not o.config:
        overrides += ["--training.dtype", "bf16"]  # QLoRA computes in bf16
    # the planned model covers the sequence; a --config file's model is the file's, as train reads it
    if "training.seq_len" in given and "model.max_seq_len" not in given and not o.config:
        model, _ = planned_model(load_config(o.config, [*(["--model.preset", preset] if preset else [])]))
        seq_len = config_keys()["training.seq_len"].from_text(values["--training.seq_len"])
        overrides += ["--model.max_seq_len", str(max(seq_len, model.max_seq_len))]
    return load_config(o.config, overrides), given


def file_sets_kv_heads(o: PlanOptions) -> bool:
    """The --config file sets model.n_kv_heads: --heads then keeps it (no multi-head default)."""
    if not o.config:
        return False
    import tomllib

    try:  # the file's own key, read before validation: the file may be valid only with the flags
        return "n_kv_heads" in tomllib.loads(Path(o.config).read_text()).get("model", {})
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
        return load_config(o.config, []).model.n_kv_heads is not None  # its one-line error


def check_gpt_shape(o: PlanOptions, model: ModelArgs, given: set[str]) -> None:
    """--arch gpt plans GPT's block (an MLP of 4 x hidden, one key/value head per query head): a
    Llama shape key that says otherwise would be dropped, so it is refused."""
    if o.config:
        raise MeshtrainError(f"--config {o.config} is a meshtrain training config (Llama): plan it with --arch llama")
    if "model.ffn_dim" in given and model.ffn_dim != 4 * model.dim:
        raise MeshtrainError(
            f"--ffn {model.ffn_dim}: --arch gpt plans GPT's MLP of 4 x --hidden = {4 * model.dim}; drop --ffn "
            "(or plan a Llama with --arch llama)"
        )
    if "model.n_kv_heads" in given and model.n_kv_heads != model.n_heads:
        raise MeshtrainError(
            f"--kv-heads {model.n_kv_heads}: --arch gpt plans multi-head attention ({model.n_heads} key/value "
            "heads); drop --kv-heads (or plan a Llama with --arch llama)"
        )
    # a preset's Llama shape is GPT's where its SwiGLU holds GPT's MLP parameters (the gpt2-* presets)
    swiglu_is_gpt = abs(3 * model.ffn_dim - 8 * model.dim) <= 0.02 * 8 * model.dim
    resized = {"model.dim", "model.n_heads", "model.ffn_dim", "model.n_kv_heads"} & given  # GPT's block from them
    if "model.preset" in given and not resized and not (swiglu_is_gpt and model.n_kv_heads == model.n_heads):
        raise MeshtrainError(
            f"--model: the preset's MLP (SwiGLU of {model.ffn_dim}) and {model.n_kv_heads} key/value heads are not "
            f"GPT's block (4 x {model.dim}, {model.n_heads} heads), which --arch gpt plans: plan it with --arch llama"
        )


def planned_shape(o: PlanOptions, model: ModelArgs, llama: Shape, given: set[str]) -> Shape:
    """The shape planned: meshtrain's Llama (always with flash attention), or GPT's block."""
    if o.arch == "llama":
        if o.attention != "flash":
            raise MeshtrainError(
                "--attention math plans GPT without flash attention: meshtrain's Llama always uses it; drop it "
                "(or plan --arch gpt)"
            )
        return llama
    check_gpt_shape(o, model, given)
    return Shape.gpt(model.dim, model.n_layers, model.n_heads, model.padded_vocab_size, model.max_seq_len)


def planned_model(cfg: Config, data: bool = False) -> tuple[ModelArgs, Shape]:
    """The shape `meshtrain train` would build from `cfg`: model.init_from's config.json where it
    names one (not the preset it replaces), checked against the sequence length as the trainer does;
    with `data` (an explained config), the vocabulary of its data where model.vocab_size is unset."""
    return resolve_model(cfg, data_vocab_size(cfg) if data else None)


def data_vocab_size(cfg: Config) -> int | None:
    """The data's vocabulary, as `train` takes it (nothing is prepared here): the prepared data's, or
    where the default corpus is not prepared yet, the one train prepares it with (data.vocab_size,
    else 8192). It fills an unset model.vocab_size, so data that is neither gets the trainer's error;
    a model with its own vocabulary (model.vocab_size, model.init_from) is only checked against it."""
    from meshtrain.job.data import DEFAULT_VOCAB, default_corpus_pending, prepared_dataset

    if default_corpus_pending(cfg):
        return cfg.data.vocab_size or DEFAULT_VOCAB
    try:
        return prepared_dataset(cfg).vocab_size
    except DataError as e:
        if cfg.model.vocab_size is not None or cfg.model.init_from:
            return None
        raise DataError(
            f"{e} (plan takes the model's vocabulary from it, as train does; or set model.vocab_size)"
        ) from None


def planned_gpus(o: PlanOptions, cfg: Config) -> int:
    """The GPUs planned: --gpus, else 8; an explained config's own world where it sets one (tp x pp x
    cp x dp_replicate x dp_shard, with parallel.dp_shard > 0), else its tp x pp x cp. A --gpus that
    contradicts the config's dp_shard, or a dp_replicate with no world to derive the shards from, is
    refused in one line (train refuses that world size)."""
    if not o.config:
        return o.gpus or 8
    p = cfg.parallel
    model_ranks = p.tp * p.pp * p.cp
    if not p.dp_shard:
        if p.dp_replicate > 1 and not o.gpus:
            raise MeshtrainError(
                f"--config {o.config} sets parallel.dp_replicate = {p.dp_replicate} and derives parallel.dp_shard "
                "from the world size: give --gpus, or set parallel.dp_shard"
            )
        return o.gpus or model_ranks
    world = model_ranks * p.dp_replicate * p.dp_shard
    if o.gpus and o.gpus != world:
        raise MeshtrainError(
            f"--gpus {o.gpus} contradicts --config {o.config}: its parallel.dp_shard = {p.dp_shard} makes tp x pp x cp "
            f"x dp_replicate x dp_shard = {world} GPUs; plan --gpus {world}, or set parallel.dp_shard = 0 to derive it"
        )
    return world


def pinned_knobs(cfg: Config, given: set[str], explain: bool) -> set[str]:
    """The layout knobs the search keeps as given: those on the command line, or all of an explained
    config's. One that only shapes another pinned one which leaves it nothing to do (--no-sequence-
    parallel with --tp 1, --pp-schedule with --pp 1, --ac-every without selective checkpointing) is
    refused in one line as `train` refuses it, rather than planned without it; with the other knob
    searched, the layouts it shapes take it. So is a pinned schedule and stage count that train refuses
    together (--pp-schedule zbv --virtual-stages 3): no layout could keep both, and replacing either
    would plan another job than the one asked for."""
    pinned = set(KNOBS) if explain else {key.partition(".")[2] for key in given}
    probe = Config()
    for key in pinned & set(KNOBS):
        if SHAPED_BY.get(key, key) in pinned:
            section = section_of(key)
            setattr(getattr(probe, section), key, getattr(getattr(cfg, section), key))
    check_keys_in_force(probe)
    if {"pp_schedule", "pp_virtual_stages"} <= pinned:
        if problem := schedule_refusal(cfg.parallel.pp_schedule, cfg.parallel.pp_virtual_stages):
            raise ConfigError(problem)
    return pinned


def check_launch_device(device: str, gpu: str) -> None:
    """A --config's launch.device names the device it trains on: a plan for another one (an H100 plan of
    a CPU job, a CPU plan of a CUDA job) would describe, and --write-config write, a job that is not
    the one it runs, so it is refused in one line (jobscript's words for the same contradiction).
    Trainium (neuron) is not modelled: plan has GPUs and the CPU only. "auto" takes the --gpu."""
    if device == "neuron":
        raise MeshtrainError(
            "launch.device = neuron trains on AWS Trainium, which plan does not model (GPUs and the CPU only): "
            "plan a GPU or CPU job (launch.device = auto, cuda or cpu)"
        )
    if device == "cpu" and gpu != "cpu":
        raise MeshtrainError(
            f"--gpu {gpu} plans GPUs, but launch.device = cpu trains on the CPU: plan it with --gpu cpu, or train "
            "on them (launch.device = auto or cuda)"
        )
    if device == "cuda" and gpu == "cpu":
        raise MeshtrainError(
            "--gpu cpu plans the CPU, but launch.device = cuda trains on GPUs: plan it with the --gpu it trains on, "
            "or train on the CPU (launch.device = auto or cpu)"
        )


def planned_peft(cfg: Config, peft: LoraSpec | None):
    """[peft] as planned, its defaults spelled out (what --write-config writes)."""
    if peft is None:
        return cfg.peft
    return dataclasses.replace(
        cfg.peft, rank=peft.rank, alpha=peft.alpha, dropout=peft.dropout, targets=cfg.peft.targets or "all"
    )


def planned_arithmetic(cfg: Config, model: ModelArgs, dtype: str, seq_len: int, dev, gpu: str, llama: bool):
    """(dtype, training with bf16_compute resolved, fp32 GEMMs, fp32 attention): "auto" as `train`
    resolves it on the planned device (a planned GPU's own bf16 units; `--gpu cpu`: this CPU's probe)."""
    t = cfg.training
    if dtype == "auto" and (gpu != "cpu" or not llama):
        dtype = "bf16" if dev.peak_tflops["bf16"] > 0 else "fp32"
    if t.bf16_compute != "auto" and dtype != "bf16":
        raise MeshtrainError(
            f"training.bf16_compute = {t.bf16_compute!r} sets the arithmetic of bf16 training, but the plan trains in "
            f"{dtype} on {gpu}: drop bf16_compute, or plan a GPU with bf16 units"
        )
    if t.attention_backward == "recompute" and gpu != "cpu":
        raise MeshtrainError(
            "training.attention_backward = 'recompute' replaces the CPU flash-attention backward, but the plan is for "
            f"{gpu}, whose attention kernels a GPU job keeps: set training.attention_backward = auto"
        )
    if not llama:
        return dtype, t, False, False
    import torch

    from meshtrain.job.arithmetic import resolve
    from meshtrain.parallel.precision import fp32_classes

    target = torch.device("cpu" if gpu == "cpu" else "cuda")
    planned = dataclasses.replace(cfg, training=dataclasses.replace(t, dtype=dtype, seq_len=seq_len))
    resolved = resolve(planned, model, target)[0].training
    return resolved.dtype, dataclasses.replace(t, bf16_compute=resolved.bf16_compute), *fp32_classes(resolved)


def write_best(o: PlanOptions, estimates: list[Estimate], base: Config) -> tuple[Path, Layout]:
    """The best layout that fits, written to --write-config as a training config (checked as train
    reads it); the path and the layout."""
    from meshtrain.files import write_text

    fitting = [e for e in estimates if e.fits]
    if o.arch != "llama":
        raise MeshtrainError(
            "--write-config writes a meshtrain training config: meshtrain trains the Llama architecture (--arch llama)"
        )
    if not fitting:
        raise MeshtrainError(
            "--write-config: no layout fits, nothing to write (more GPUs, a smaller model or batch, or --ac full)"
        )
    best = fitting[0].layout.apply_to(base)
    path = write_text(o.write_config, f"{PLAN_HEADER}\n{to_toml(best.validate())}")  # what is written must train
    return path, fitting[0].layout


@dataclass
class Plan:
    """What `make_plan` found: the request as resolved, and the layouts (best first) and the ones that
    could not be."""

    shape: Shape
    device: Device
    inter_node_gbps: float
    gpus: int
    seq_len: int
    global_batch: int
    dtype: str
    fp8: str
    objective: str
    peft: LoraSpec | None
    estimates: list[Estimate]
    refused: list[str]
    base: Config  # the training config each layout applies to (what --write-config writes, --verify builds)
    model: ModelArgs

    def title(self) -> str:
        dev, shape, peft = self.device, self.shape, self.peft
        active = sum(shape.active_numel(p) for p in shape.parameters())
        experts = f" ({shape.n_experts} experts, {active / 1e9:.2f}B active)" if shape.n_experts else ""
        return (
            f"{shape.arch} {shape.n_params() / 1e9:.2f}B{experts} on {self.gpus} x {dev.name} "
            f"({dev.gpus_per_node} per node, {dev.link} {dev.intra_node_gbps:.0f} GB/s, "
            f"network {self.inter_node_gbps:.1f} GB/s per GPU), seq "
            f"{self.seq_len}, global batch {self.global_batch}{' pairs' if self.objective == 'dpo' else ''}, "
            f"{self.dtype}"
            + (f", fp8 {self.fp8}" if self.fp8 != "off" else "")
            + (f", {peft.method} rank {peft.rank} on {','.join(peft.targets)}" if peft else "")
        )

    def as_dict(self, top: int | None, built: dict[int, dict]) -> dict:
        """The JSON report: the request, the first `top` layouts (with what a dry run built), the refused."""
        dev = self.device
        return {
            "model": {"arch": self.shape.arch, "params": self.shape.n_params(), **dataclasses.asdict(self.shape)},
            "device": dev.name,
            "gpus": self.gpus,
            "gpus_per_node": dev.gpus_per_node,
            "memory_gib": dev.memory_gib,
            "host_memory_gib": dev.host_memory_gib,
            "pcie_gbs": dev.pcie_gbs,
            "intra_node_gbps": dev.intra_node_gbps,
            "inter_node_gbps": self.inter_node_gbps,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "dtype": self.dtype,
            "fp8": self.fp8,
            "objective": self.objective,
            "peft": self.peft.to_dict() if self.peft else None,
            "layouts": [
                {**e.as_dict(), **({"built": built[i]} if i in built else {})}
                for i, e in enumerate(self.estimates[:top])
            ],
            "not_possible": self.refused,
        }


def make_plan(o: PlanOptions, overrides: list[str]) -> Plan:
    """The request resolved (refused in one line where it cannot be planned), then the search."""
    cfg, given = load_request(o, overrides)
    check_launch_device(cfg.launch.device, o.gpu)
    if cfg.parallel.ep > 1:
        raise ConfigError(
            f"parallel.ep = {cfg.parallel.ep}: meshtrain plan does not model expert parallelism yet (its all-to-all "
            "and the experts' split); plan the config with parallel.ep = 1, or measure it with `meshtrain train`"
        )
    explain = bool(o.config)
    t = cfg.training
    model, llama_shape = planned_model(cfg, data=explain)
    llama = o.arch == "llama"
    seq_len = t.seq_len if explain or "training.seq_len" in given else min(2048, model.max_seq_len)
    shape = planned_shape(o, model, llama_shape, given)
    gpus = planned_gpus(o, cfg)
    global_batch = t.global_batch_size if explain or "training.global_batch_size" in given else 4 * gpus
    gpus_per_node = o.gpus_per_node or (gpus if o.gpu == "cpu" else min(gpus, 8))
    links = (o.network, o.intra_node_gbps, o.inter_node_gbps)
    dev, inter = device(o.gpu, gpus_per_node, *links, o.memory_gib, o.efficiency, o.comm, o.host_memory_gib)
    check_links(o, gpus, dev.gpus_per_node)
    planned_dtype = "bf16" if dev.peak_tflops["bf16"] > 0 else "fp16"
    dtype = t.dtype if explain or "training.dtype" in given else planned_dtype
    compiled, cuda_graphs = (getattr(t, k) if explain or f"training.{k}" in given else False for k in COMPILE_KEYS)
    check_compiled(compiled, cuda_graphs, llama, o.gpu)
    check_precision(dev, t.fp8, cfg.parallel.cpu_offload, o.host_memory_gib)
    check_peak(t.peak_tflops, t.fp8)
    # after the refusals above: on a CPU it measures the arithmetic (seconds to minutes)
    dtype, t, fp32_gemm, fp32_attention = planned_arithmetic(cfg, model, dtype, seq_len, dev, o.gpu, llama)
    dev.peak(dtype)  # a clear error for bf16 on a V100
    dev = dev.with_peak(dtype, t.peak_tflops) if t.peak_tflops else dev
    peft = adapters_of(cfg.peft, moe=bool(shape.moe_layers))
    pinned = pinned_knobs(cfg, given, explain)
    if "cp" in pinned:
        check_cp(shape, cfg.parallel.cp, cfg.parallel.tp if "tp" in pinned else 1, gpus, seq_len)
    check_peft(peft, o.arch, dtype, gpus, {k: getattr(cfg.parallel, k) for k in ("tp", "pp", "zero") if k in pinned})
    kernels = "cpu" if o.gpu == "cpu" else "cuda"
    w = Workload(
        shape, seq_len, dtype, fp32_gemm, o.attention, kernels, compiled, fp32_attention, peft, t.objective, t.fp8
    )
    w = dataclasses.replace(w, cuda_graphs=cuda_graphs)
    fixed = {k: getattr(getattr(cfg, section_of(k)), k) for k in KNOBS if k in pinned}
    training = dataclasses.replace(
        t, seq_len=seq_len, global_batch_size=global_batch, compile=compiled, cuda_graphs=cuda_graphs
    )
    training.dtype = dtype
    training.bf16_compute = t.bf16_compute if dtype == "bf16" else "auto"
    # the planned vocabulary, written: a search plans the preset's, where train would take the data's
    vocab = dataclasses.replace(cfg.model, vocab_size=model.vocab_size)
    # the planned device, written: a CPU plan's arithmetic (its probe's) is not a GPU's
    launch = dataclasses.replace(cfg.launch, device="cpu" if o.gpu == "cpu" else "cuda")
    base = dataclasses.replace(cfg, model=vocab, training=training, peft=planned_peft(cfg, peft), launch=launch)
    estimates, refused = search(w, dev, inter, gpus, global_batch, fixed, base if llama else None, model)
    return Plan(
        shape, dev, inter, gpus, seq_len, global_batch, dtype, t.fp8, t.objective, peft, estimates, refused, base, model
    )


FAILURE_KEYS = ("failure_days", "restart_s", "storage_gbps", "replica_groups")
MAX_GROUP_EVENTS = 10_000_000  # failures x replica groups: about 2 s a replay
CHECKPOINT_BYTES_PER_PARAM = 12  # what a checkpoint holds of each trained parameter: fp32 weight, AdamW's 2 moments


def trained_numel(shape: Shape, peft: LoraSpec | None) -> int:
    """The parameters a checkpoint holds, one copy: every one, or with [peft] the adapters alone (the
    frozen base is the model the run started from)."""
    from meshtrain.plan.states import adapters

    params = shape.parameters() if peft is None else adapters(shape.parameters(), peft)
    return sum(math.prod(p.shape) for p in params)


def check_failure_options(o: PlanOptions) -> None:
    """The --failures settings take effect only with --failures: alone, they are refused."""
    given = [k for k in FAILURE_KEYS if getattr(o, k) is not None]
    if given and o.failures is None:
        flag = "--" + given[0].replace("_", "-")
        raise MeshtrainError(f"{flag} sets the failure replay: add --failures RATE (or --failures llama3)")


def failure_report(o: PlanOptions, plan: Plan) -> dict:
    """Effective training time of the best layout that fits under --failures: its step time, a checkpoint of the
    trained parameters (fp32 weights and AdamW's moments, one copy) at --storage-gbps, a restart that
    relaunches and reads that checkpoint back, and a group's rejoin that relaunches and takes its share
    of a live peer's states over the inter-node link."""
    best = next((e for e in plan.estimates if e.fits), None)
    if best is None:
        why = plan.estimates[0].why_not if plan.estimates else "; ".join(plan.refused)
        raise MeshtrainError(f"--failures: no layout fits to replay failures on ({why})")
    layout = best.layout
    days = o.failure_days or 54.0
    dp = layout.dp_replicate * layout.dp_shard
    groups = o.replica_groups or dp
    replayed = o.failures * plan.gpus / 1000 * days
    if replayed * groups > MAX_GROUP_EVENTS:  # each failure looks at every group
        raise MeshtrainError(
            f"--failures {o.failures:g} on {plan.gpus} GPUs for {days:g} days replays {replayed:,.0f} failures "
            f"over {groups} replica groups: at most {MAX_GROUP_EVENTS:,} failures x groups; lower the rate, "
            "--failure-days or --replica-groups"
        )
    if groups < 2 or dp % groups:
        raise MeshtrainError(
            f"{groups} replica groups do not divide the data-parallel degree {dp} of the best layout "
            f"({layout.describe()}): give --replica-groups a divisor of {dp} of at least 2, or pin a layout with "
            "more data parallelism"
        )
    checkpoint_bytes = CHECKPOINT_BYTES_PER_PARAM * trained_numel(plan.shape, plan.peft)
    per_gpu = checkpoint_bytes / (plan.gpus / dp)  # a rejoining group takes its share from a peer
    storage = (o.storage_gbps or 100.0) * 1e9
    relaunch = 600.0 if o.restart_s is None else o.restart_s
    times = JobTimes(
        step=best.speed["step_time_s"],
        checkpoint=checkpoint_bytes / storage,
        restart=relaunch + checkpoint_bytes / storage,
        rejoin=relaunch + per_gpu / (plan.inter_node_gbps * 1e9),
    )
    return {
        "rate_per_1000_gpu_days": o.failures,
        "days": days,
        "seconds": {k: round(v, 3) for k, v in dataclasses.asdict(times).items()},
        "modes": [outcome.as_dict() for outcome in compare(o.failures, plan.gpus, groups, times, days)],
    }
