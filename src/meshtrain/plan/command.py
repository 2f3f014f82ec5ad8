"""`meshtrain plan` from its command-line arguments: resolve the model, the job and the device,
search (or explain one layout), print, and write the best layout as a training config."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from meshtrain.config import Config, load_config, to_toml
from meshtrain.errors import MeshtrainError
from meshtrain.model.llama import ModelArgs
from meshtrain.model.presets import PRESETS
from meshtrain.plan.hardware import device
from meshtrain.plan.layout import Workload, to_config
from meshtrain.plan.search import search
from meshtrain.plan.shapes import Shape

KNOBS = ("tp", "pp", "zero", "dp_replicate", "micro_batch", "ac", "pp_schedule", "virtual_stages", "sequence_parallel")


def _base_config(args) -> Config:
    if args.config:
        return load_config(args.config)
    if args.model and args.model not in PRESETS:
        hint = " (a config file is --config FILE)" if Path(args.model).is_file() else ""
        raise MeshtrainError(f"--model.preset {args.model!r} is not a preset: use one of {', '.join(PRESETS)}{hint}")
    return load_config(overrides={"model.preset": args.model} if args.model else None)


def _model(args, cfg: Config) -> ModelArgs:
    """The config's (or preset's) model with the shape flags applied."""
    overrides = {
        "n_layers": args.layers,
        "dim": args.hidden,
        "n_heads": args.heads,
        "n_kv_heads": args.kv_heads,
        "ffn_dim": args.ffn,
        "vocab_size": args.vocab,
    }
    model = cfg.model_args()
    model = dataclasses.replace(model, **{k: v for k, v in overrides.items() if v is not None})
    if args.heads and not args.kv_heads:
        model.n_kv_heads = args.heads
    for key, value in dataclasses.asdict(model).items():
        if type(value) is int and value <= 0:
            raise MeshtrainError(f"model {key} must be positive, got {value}")
    if model.dim % model.n_heads or model.n_heads % model.n_kv_heads:
        raise MeshtrainError(
            f"--hidden ({model.dim}) must be divisible by --heads ({model.n_heads}), and --heads "
            f"by --kv-heads ({model.n_kv_heads})"
        )
    return model


def run_plan(args) -> int:
    cfg = _base_config(args)
    explain = bool(args.config)
    t = cfg.training
    model = _model(args, cfg)
    llama = args.arch == "llama"
    seq_len = args.seq_len or (t.seq_len if explain else min(2048, model.max_seq_len))
    shape = (
        Shape.from_args(model)
        if llama
        else Shape.gpt(
            model.dim, model.n_layers, model.n_heads, model.padded_vocab_size, max(seq_len, model.max_seq_len)
        )
    )
    gpus = args.gpus or (cfg.parallel.tp * cfg.parallel.pp if explain else 8)
    global_batch = args.global_batch or (t.global_batch_size if explain else 4 * gpus)
    gpus_per_node = args.gpus_per_node or (gpus if args.gpu == "cpu" else min(gpus, 8))
    dev, inter = device(
        args.gpu,
        gpus_per_node,
        args.network,
        args.intra_node_gbps,
        args.inter_node_gbps,
        args.memory_gib,
        args.peak_tflops,
        args.efficiency,
        args.comm,
    )
    dtype = args.dtype or (t.dtype if explain else "bf16" if dev.peak_tflops["bf16"] > 0 else "fp16")
    dev.peak(dtype)  # a clear error for bf16 on a V100
    fp32_arithmetic = False
    if dtype == "bf16" and args.gpu == "cpu" and args.arch == "llama":
        import torch

        from meshtrain.parallel.precision import wants_fp32_compute

        fp32_arithmetic = wants_fp32_compute(dataclasses.replace(t, dtype="bf16"), torch.device("cpu"))
    compiled = args.compile if args.compile is not None else (t.compile if explain else False)
    if compiled and args.arch != "llama":
        raise MeshtrainError("--compile plans meshtrain's compiled Llama blocks: drop it with --arch gpt")
    device_type = "cpu" if args.gpu == "cpu" else "cuda"
    w = Workload(shape, seq_len, global_batch, dtype, fp32_arithmetic, args.attention, device_type, compiled)
    fixed = {k: getattr(args, k) for k in KNOBS}
    if explain:
        p = cfg.parallel
        from_config = {
            "tp": p.tp,
            "pp": p.pp,
            "zero": p.zero,
            "dp_replicate": p.dp_replicate,
            "micro_batch": t.micro_batch_size,
            "ac": t.activation_checkpointing,
            "pp_schedule": p.pp_schedule,
            "virtual_stages": p.pp_virtual_stages,
            "sequence_parallel": p.sequence_parallel,
        }
        fixed = {k: v if v is not None else from_config[k] for k, v in fixed.items()}
    estimates, refused = search(w, dev, inter, gpus, fixed, cfg if llama else None, model if llama else None)

    if args.write_config:
        _write_config(args, estimates, w, cfg, model)
    built = _verify(args, estimates, w, cfg, model) if args.verify else {}
    if args.json:
        print(
            json.dumps(
                {
                    "model": {"arch": shape.arch, "params": shape.n_params(), **dataclasses.asdict(shape)},
                    "device": dev.name,
                    "gpus": gpus,
                    "gpus_per_node": dev.gpus_per_node,
                    "memory_gib": dev.memory_gib,
                    "intra_node_gbps": dev.intra_node_gbps,
                    "inter_node_gbps": inter,
                    "seq_len": seq_len,
                    "global_batch": global_batch,
                    "dtype": dtype,
                    "layouts": [
                        {**e.as_dict(), **({"built": built[i]} if i in built else {})} for i, e in enumerate(estimates)
                    ],
                    "not_possible": refused,
                },
                indent=1,
            )
        )
        return 0
    from rich.console import Console

    from meshtrain.plan.report import render

    title = (
        f"{shape.arch} {shape.n_params() / 1e9:.2f}B on {gpus} x {dev.name} ({dev.gpus_per_node} per node, "
        f"{dev.link} {dev.intra_node_gbps:.0f} GB/s, network {inter:.1f} GB/s per GPU), seq {seq_len}, "
        f"global batch {global_batch}, {dtype}"
    )
    render(title, estimates, refused, args.top, Console(width=None if sys.stdout.isatty() else 120))
    for i, gib in built.items():
        cells = ", ".join(f"{k} {v:.2f}" for k, v in gib.items() if v is not None)
        print(f"built (dry run) #{i + 1} {estimates[i].layout.describe()}: {cells} GiB on its busiest rank")
    return 0


def _training_config(layout, w: Workload, cfg: Config, model: ModelArgs) -> Config:
    """The training config of a planned layout, with the planned model's shape."""
    best = to_config(layout, w, cfg)
    shape = {k: getattr(model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")}
    return dataclasses.replace(best, model=dataclasses.replace(best.model, **shape))


def _verify(args, estimates, w: Workload, cfg: Config, model: ModelArgs) -> dict[int, dict]:
    """`train --dry-run` of the best `args.verify` layouts that fit: what the busiest built rank holds,
    in GiB, with the keys of memory_gib (None where the dry run does not measure it)."""
    from meshtrain.plan.dry_run import KEYS, dry_run

    if args.arch != "llama":
        raise MeshtrainError("--verify builds the layout with meshtrain's trainer, which trains Llama (--arch llama)")
    if w.dtype == "fp16":
        raise MeshtrainError("--verify: meshtrain trains in bf16 or fp32; plan with --dtype bf16")
    out = {}
    for i, e in enumerate(estimates[: args.verify]):
        job = _training_config(e.layout, w, cfg, model)
        job = dataclasses.replace(  # the planned vocabulary and arithmetic, not the CPU's measured choice
            job,
            model=dataclasses.replace(job.model, vocab_size=model.vocab_size),
            training=dataclasses.replace(job.training, bf16_compute="fp32" if w.fp32_arithmetic else "bf16"),
        )
        reports = dry_run(job, e.layout.world)
        busiest = max(reports, key=lambda r: sum(r.built.values()))
        out[i] = {k: round(busiest.built[k] / 2**30, 3) if k in busiest.built else None for k in KEYS}
        out[i]["rank"] = busiest.rank
    return out


def _write_config(args, estimates, w: Workload, cfg: Config, model: ModelArgs) -> None:
    from meshtrain.files import write_text

    fitting = [e for e in estimates if e.fits]
    if args.arch != "llama":
        raise MeshtrainError(
            "--write-config writes a meshtrain training config: meshtrain trains the Llama architecture (--arch llama)"
        )
    if not fitting:
        raise MeshtrainError(
            "--write-config: no layout fits, nothing to write (more GPUs, a smaller model or batch, or --ac full)"
        )
    if w.dtype == "fp16":
        raise MeshtrainError("--write-config: meshtrain trains in bf16 or fp32; plan with --dtype bf16")
    best = _training_config(fitting[0].layout, w, cfg, model)
    path = write_text(args.write_config, to_toml(best.validate()))  # what is written must train
    print(
        f"wrote {path} ({fitting[0].layout.describe()}); run it with `meshtrain train --config {path}` on "
        f"{fitting[0].layout.world} processes, or `meshtrain jobscript slurm --config {path} ...`"
    )
