"""Preflight: every check a job makes before any work, in one place, and the planner's word on it.

`preflight` is what the launcher (`train --nproc`), each worker (`build`), the dry run and `jobscript`
run, so a job is refused in the same words wherever it would fail: the resolved model's shape, the
layout against it at the job's world size, the batch and the schedule, and the data (its vocabulary,
and with model.init_from its tokenizer and chat template). Then `warn_if_too_big` (the planner's
peak against the device) and, with run.plan_check, `compare` (its prediction beside what ran)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from meshtrain.config import Config, check_keys_in_force, check_model_args, parse_data_path
from meshtrain.data import Blend, prepare, read_manifest, stdlib_sources
from meshtrain.data.format import MANIFEST
from meshtrain.layout import Layout
from meshtrain.logs import log
from meshtrain.model import ModelArgs
from meshtrain.model.shapes import Shape
from meshtrain.plan import Workload, estimate_memory, model_state_bytes
from meshtrain.plan.workload import cuda_graphs_refusal, fp8_shape_refusal, nf4_refusal

GIB = 2**30
DEFAULT_VOCAB = 8192  # the default corpus's BPE vocabulary where data.vocab_size is unset


def ensure_dataset(cfg: Config) -> Blend:
    """Build the default corpus on first use (data.corpus = "stdlib", data.path one directory);
    otherwise the data must already be prepared. Called by the launcher before workers start, and
    by rank 0 of a run started by an external launcher."""
    paths = [Path(p) for p, _ in parse_data_path(cfg.data.path)]
    if default_corpus_pending(cfg):
        check_objective_data(cfg, None)  # not minutes of preparing before the refusal
        log.info(f"preparing the default corpus (Python standard library source) in {paths[0]} ...")
        prepare(stdlib_sources(), paths[0], vocab_size=cfg.data.vocab_size or DEFAULT_VOCAB, progress=True)
    check_prepared_vocabulary(cfg)
    return Blend(cfg.data.path, cfg.training.seq_len)


def model_args(cfg: Config, data_vocab_size: int | None = None) -> ModelArgs:
    """The model's shape: the preset, or a Hugging Face directory's config.json, with the overrides."""
    if cfg.model.init_from:
        from meshtrain.config.checks import SHAPE_KEYS
        from meshtrain.errors import ConfigError
        from meshtrain.interop.hf import check_context_length, hf_model_args

        if cfg.model.preset is not None:
            raise ConfigError(
                f"model.preset = {cfg.model.preset!r} but model.init_from's config.json is the model's shape: "
                "drop model.preset (or model.init_from, to train the preset from scratch)"
            )
        base = hf_model_args(cfg.model.init_from.removeprefix("hf:"))
        for key in SHAPE_KEYS:  # its weights have this shape: a key that says otherwise cannot hold
            value, theirs = getattr(cfg.model, key), base.head_size if key == "head_dim" else getattr(base, key)
            if value is not None and value != theirs:
                raise ConfigError(
                    f"model.{key} = {value} but model.init_from's config.json has {theirs}: drop "
                    f"model.{key} (the pretrained weights fix it; only max_seq_len and vocab_multiple may change)"
                )
        args = cfg.model_args(base=base)
        if args.max_seq_len > base.max_seq_len:
            check_context_length(cfg.model.init_from.removeprefix("hf:"), args.max_seq_len)
        return args
    return cfg.model_args(data_vocab_size)


def preflight(cfg: Config, world: int, dataset: Blend | None = None) -> tuple[ModelArgs, Layout]:
    """The model and the layout of `cfg` on `world` ranks, or the one-line reason it cannot train.
    `dataset`: the prepared data (None where it is not here yet, as for the default corpus)."""
    vocab = dataset.vocab_size if dataset is not None else None
    check_keys_in_force(cfg)
    args = model_args(cfg, vocab)
    check_model_args(args, cfg, vocab)
    layout = Layout.from_config(cfg, world)
    layout.validate(args, cfg)
    check_peft_layout(cfg, layout, args)
    if cfg.training.cuda_graphs and (problem := cuda_graphs_refusal(layout)):
        from meshtrain.errors import ConfigError

        raise ConfigError(problem)
    check_fp8_shapes(cfg, layout, args)
    if dataset is not None:
        check_init_tokenizer(cfg, dataset)
        check_objective_data(cfg, dataset)
        check_sample_fits(cfg, args, dataset)
    return args, layout


def check_sample_fits(cfg: Config, args: ModelArgs, dataset: Blend) -> None:
    """The end-of-run sample is the prompt's tokens and run.sample_tokens more in the model's context:
    a prompt that fills it, or a given sample_tokens beside it, would be cut silently (the default
    sample_tokens is cut to fit)."""
    from meshtrain.data.tokenizer import encode_prompt, load_tokenizer
    from meshtrain.errors import ConfigError

    r = cfg.run
    if not r.sample_prompt:
        return
    prompt = len(encode_prompt(load_tokenizer(dataset.tokenizer_path), r.sample_prompt))
    given = r.sample_tokens != type(r)().sample_tokens
    if prompt >= args.max_seq_len or (given and prompt + r.sample_tokens > args.max_seq_len):
        tokens = f" and run.sample_tokens = {r.sample_tokens}" if given else ""
        raise ConfigError(
            f"run.sample_prompt ({prompt} tokens){tokens} would not fit the model's context (model.max_seq_len = "
            f"{args.max_seq_len}): shorten the prompt{' or lower sample_tokens' if given else ''}"
        )


def workers_device(cfg: Config) -> torch.device:
    """The kind of device the workers of `train --nproc` on this host will train on (launch/distributed.py
    picks each one's): for checking it before they start."""
    if cfg.launch.device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device(cfg.launch.device if cfg.launch.device == "neuron" else "cpu")


def check_device(cfg: Config, device: torch.device, launcher: bool = False) -> None:
    """What the device the job trains on must offer (run where it trains: the launcher on the training
    host, and each worker; not jobscript, whose login node may lack the cluster's GPUs): FP8 units
    for training.fp8, a GPU to offload from for parallel.cpu_offload. The `launcher` leaves the FP8
    units to its workers: asking CUDA for them would hold a context on GPU 0 for the whole job."""
    from meshtrain.errors import ConfigError

    if not launcher:
        from meshtrain.parallel.float8 import fp8_refusal  # (the parallel stack: seconds the launcher saves)

        if problem := fp8_refusal(cfg.training.fp8, device):
            raise ConfigError(problem)
    if cfg.training.attention_backward == "recompute" and device.type != "cpu":
        raise ConfigError(
            f"training.attention_backward = 'recompute' replaces the CPU flash-attention backward, but this job trains "
            f"on {device.type}, whose attention kernels it keeps: set training.attention_backward = auto (or flash)"
        )
    if cfg.training.cuda_graphs and device.type != "cuda":
        raise ConfigError(
            f"training.cuda_graphs replays the step's kernels as CUDA graphs, but this job trains on {device.type}: "
            "drop training.cuda_graphs (or train on a GPU)"
        )
    if cfg.parallel.cpu_offload and device.type == "cpu":
        raise ConfigError(
            "parallel.cpu_offload moves ZeRO-3's shards from GPU memory to host memory, but this job trains on the "
            "CPU, where they already are: drop parallel.cpu_offload (or train on GPUs)"
        )


def check_fp8_shapes(cfg: Config, layout: Layout, args: ModelArgs) -> None:
    """training.fp8's GEMMs at this layout (plan/workload.fp8_shape_refusal, which plan checks too)."""
    from meshtrain.errors import ConfigError

    if problem := fp8_shape_refusal(Shape.from_args(args), layout.tp, cfg.training.fp8):
        raise ConfigError(problem)


def check_peft_layout(cfg: Config, layout: Layout, args: ModelArgs) -> None:
    """What LoRA, QLoRA and DPO run on."""
    from meshtrain.errors import ConfigError
    from meshtrain.model.args import LoraSpec

    if problem := nf4_refusal(Shape.from_args(args), LoraSpec.from_config(cfg.peft)):
        raise ConfigError(problem)

    if cfg.peft.method == "qlora" and (layout.tp > 1 or layout.pp > 1 or layout.fsdp):
        raise ConfigError(
            "peft.method = qlora keeps a whole 4-bit base on each rank: use one process or DDP (parallel.zero 0 "
            "or 1, tp = pp = 1), or peft.method = lora, which shards its base with ZeRO-3 and TP"
        )
    if cfg.training.objective == "dpo" and layout.pp > 1:
        raise ConfigError(
            "training.objective = dpo is not implemented for pipelines (parallel.pp > 1): use ZeRO-3 or TP"
        )


def check_objective_data(cfg: Config, dataset: Blend | None) -> None:
    """DPO learns from preference pairs, and only DPO does. `dataset` None: not prepared yet, so the
    default corpus (plain text) would be: refused before it is prepared."""
    from meshtrain.errors import ConfigError

    preference = getattr(dataset, "preference", False)
    if cfg.training.objective == "dpo" and not preference:
        what = "is not" if dataset is not None else f"holds no data yet (data.corpus {cfg.data.corpus!r} is plain text)"
        raise ConfigError(
            f"training.objective = dpo learns from preference pairs, but {cfg.data.path} {what}: prepare them "
            "with `meshtrain data prepare --format preference`"
        )
    if preference and cfg.training.objective != "dpo":
        raise ConfigError(
            f"{cfg.data.path} holds preference pairs: train on them with training.objective = dpo "
            "(plain chat data is prepared with --format chat)"
        )


def default_corpus_pending(cfg: Config) -> bool:
    """data.path is one directory with no data yet, where training prepares the default corpus."""
    paths = parse_data_path(cfg.data.path)
    return len(paths) == 1 and not (Path(paths[0][0]) / MANIFEST).is_file() and bool(cfg.data.corpus)


def prepared_dataset(cfg: Config) -> Blend | None:
    """The data as it is here, for checks that prepare nothing (dry run, jobscript): None when it is
    not prepared yet but the default corpus would be; the trainer's error when it is missing or
    corrupt otherwise."""
    if default_corpus_pending(cfg):
        return None
    check_prepared_vocabulary(cfg)
    return Blend(cfg.data.path, cfg.training.seq_len)


def check_prepared_vocabulary(cfg: Config) -> None:
    """Each prepared directory of data.path is there and whole (the trainer's one-line error for
    missing or corrupt data), and prepared with data.vocab_size where that is set."""
    from meshtrain.errors import DataError

    for path in (Path(p) for p, _ in parse_data_path(cfg.data.path)):
        prepared = read_manifest(path)["vocab_size"]
        if cfg.data.vocab_size is not None and prepared != cfg.data.vocab_size:
            raise DataError(
                f"data.vocab_size = {cfg.data.vocab_size} but {path} is prepared with a vocabulary of {prepared}: "
                "drop data.vocab_size to train on it, or prepare the data again into another data.path"
            )


def check_init_tokenizer(cfg: Config, dataset: Blend) -> None:
    """model.init_from: the data must be tokenized with the pretrained model's tokenizer, or every
    id means another token than the one the weights learned (a silent, wrong fine-tune)."""
    if not cfg.model.init_from:
        return
    from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, template_of
    from meshtrain.data.tokenizer import tokenizer_fingerprint
    from meshtrain.errors import DataError

    model_dir = Path(cfg.model.init_from.removeprefix("hf:"))
    theirs = model_dir / "tokenizer.json"
    if not theirs.is_file():
        log.warning(f"{model_dir} has no tokenizer.json: cannot check that {cfg.data.path} was tokenized with it")
        return
    if tokenizer_fingerprint(theirs) != tokenizer_fingerprint(dataset.tokenizer_path):
        raise DataError(
            f"{cfg.data.path} was tokenized with another tokenizer than model.init_from ({theirs}): prepare the data "
            f"with it, `meshtrain data prepare --tokenizer {theirs} ...`"
        )
    if dataset.template_path and template_of(model_dir) != DEFAULT_CHAT_TEMPLATE:
        if dataset.template_path.read_text() != template_of(model_dir):
            raise DataError(
                f"{cfg.data.path} was rendered with another chat template than model.init_from's ({model_dir}): "
                f"prepare it with `--tokenizer {theirs}` (which takes the model's template along)"
            )


def workload_of(cfg: Config, args: ModelArgs, device: torch.device) -> Workload:
    """What the planner needs beside the layout: the model, the sequence, the kernels that run (of a
    config whose arithmetic is resolved, train/arithmetic.py), the adapters and the objective."""
    from meshtrain.plan.workload import workload_of_config

    return workload_of_config(cfg, Shape.from_args(args), "cuda" if device.type == "cuda" else "cpu")


def device_capacity(device: torch.device, local_world_size: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local_world_size)


def warn_if_too_big(cfg: Config, args: ModelArgs, layout: Layout, device: torch.device, local_world_size: int) -> None:
    """A warning before the model is materialised when the planner predicts it will not fit."""
    runtime = 1.0 if device.type == "cuda" else 0.0
    fragmentation = 0.05 if device.type == "cuda" else 0.0
    predicted = estimate_memory(workload_of(cfg, args, device), layout, runtime, fragmentation)["total"]
    capacity = device_capacity(device, local_world_size)
    if predicted > capacity:
        log.warning(
            f"the planner predicts {predicted / GIB:.1f} GiB on the busiest rank for this layout, more than "
            f"the {capacity / GIB:.1f} GiB of {device.type} memory per rank: expect running out of memory; "
            f"`meshtrain plan --config <this config> --gpu ... --gpus {layout.world}` shows layouts that fit"
        )


def compare(cfg: Config, args: ModelArgs, device: torch.device, measured: list[dict[str, int]]) -> list[str]:
    """run.plan_check: one line per rank, predicted vs measured model states, and the predicted peak."""
    w, layout = workload_of(cfg, args, device), Layout.from_config(cfg, len(measured))
    peak = estimate_memory(w, layout)["total"]
    lines = []
    for rank, got in enumerate(measured):
        predicted = model_state_bytes(w.shape, layout, rank, w.peft, w.dtype)
        states = " | ".join(f"{k} {predicted[k] / 2**20:.2f}/{got[k] / 2**20:.2f}" for k in predicted)
        lines.append(
            f"rank {rank} planner/measured MiB: {states} | predicted peak of a step {peak / 2**20:.1f} "
            f"MiB (busiest rank; tensors only, the process adds its runtime)"
        )
    return lines
