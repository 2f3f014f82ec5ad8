"""The training loop: who am I -> data -> model on the mesh -> step, log, evaluate -> save, sample.

One training step on each rank:
  loader.next_batch()            this DP rank's slice of the global batch (global / DP sequences)
  forward_backward()             micro-batches of training.micro_batch_size; DDP averages gradients
                                 on the last one (no_sync before), so global = micro x accum x DP
  clip_grad_norm_ -> AdamW -> LR  (linear warm-up, cosine decay)
  every run.log_every steps      loss averaged over DP ranks, tokens/s, TFLOP/s, MFU -> rank 0 sinks
"""

from __future__ import annotations

import math
import os
import shutil
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtrain.config import Config, grad_accum_steps, validate, write_resolved
from meshtrain.data import Dataset, DistributedLoader, prepare, read_manifest, stdlib_sources, validation_batches
from meshtrain.launch import LaunchEnv, detect
from meshtrain.metrics import MetricsLogger, Throughput, device_peak_tflops
from meshtrain.model import Llama, ModelArgs, flops_per_token, num_params
from meshtrain.parallel import ParallelDims
from meshtrain.parallel.data_parallel import apply_ddp


def init_distributed(env: LaunchEnv) -> torch.device:
    """One process per device: CUDA + NCCL where there is a GPU, else CPU + gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"  # gloo too, for object collectives and CPU tensors
    else:
        device, backend = torch.device("cpu"), "gloo"
    if env.distributed and not dist.is_initialized():
        env.export()
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    return device


def ensure_dataset(cfg: Config) -> None:
    """Build the default corpus on first use (data.corpus = "stdlib"); otherwise the data must
    already be prepared. Called by the launcher before workers start, and by rank 0 of a run
    started by an external launcher."""
    path = Path(cfg.data.path)
    if (path / "manifest.json").is_file() or not cfg.data.corpus:
        read_manifest(path)  # raises a clear error if missing or corrupt
        return
    print(f"preparing the default corpus (Python standard library source) in {path} ...", flush=True)
    prepare(stdlib_sources(), path, vocab_size=cfg.data.vocab_size, progress=True)


def load_dataset(cfg: Config, env: LaunchEnv) -> Dataset:
    if env.rank == 0:
        ensure_dataset(cfg)
    if dist.is_initialized():
        dist.barrier()
    return Dataset(cfg.data.path, cfg.training.seq_len)


def build_model(args: ModelArgs, dims: ParallelDims, seed: int, device: torch.device) -> nn.Module:
    """Build on `meta` (no memory), apply the parallelisms, then materialise and initialise the
    weights this rank holds, identically in every layout."""
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device=device)
    model.init_weights(seed, buffer_device=device)
    if dims.dp > 1:
        model = apply_ddp(model, dims.mesh("dp"))
    return model


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device):
    t = cfg.training
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norms
    ]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                                  fused=fused or None, foreach=None if fused else True)

    def lr_factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int,
                     device: torch.device, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Accumulate gradients over micro-batches; returns this rank's mean loss (a tensor: no sync)."""
    chunks = list(zip(inputs.split(micro_batch), targets.split(micro_batch)))
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(chunks):
        last = i == len(chunks) - 1
        sync = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                logits = model(_to_device(x, device))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), _to_device(y, device).flatten()) / len(chunks)
            loss.backward()
        total += loss.detach()
    return total


@torch.no_grad()
def evaluate(model: nn.Module, batches, micro_batch: int, device: torch.device, autocast_dtype,
             group) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    count = 0
    for inputs, targets in batches:
        for x, y in zip(inputs.split(micro_batch), targets.split(micro_batch)):
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                logits = model(_to_device(x, device))
            total += F.cross_entropy(logits.flatten(0, 1).float(), _to_device(y, device).flatten())
            count += 1
    model.train()
    return mean_over(total / count, group)


def mean_over(value: torch.Tensor, group) -> float:
    """The mean of a scalar over a process group (every member must call this)."""
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value.item()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU, from any layout (other ranks get {})."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_model(state: dict[str, torch.Tensor], args: ModelArgs, run_dir: Path) -> Path:
    """model.safetensors + model.json (shape), written under temporary names and renamed."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in state.items() if not (args.tie_embeddings and k == "output.weight")}
    tmp = run_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(run_dir / "model.safetensors")
    (run_dir / "model.json.tmp").write_text(json.dumps(dataclasses.asdict(args), indent=2))
    (run_dir / "model.json.tmp").replace(run_dir / "model.json")
    return run_dir / "model.safetensors"


def sample_text(state: dict[str, torch.Tensor], args: ModelArgs, tokenizer_path: Path, prompt: str,
                max_new_tokens: int, eos_id: int | None) -> str:
    from tokenizers import Tokenizer

    from meshtrain.model.generate import generate

    model = Llama(args)
    model.load_state_dict(state, strict=False)
    tok = Tokenizer.from_file(str(tokenizer_path))
    new = generate(model, tok.encode(prompt).ids, max_new_tokens, stop_token=eos_id)
    return prompt + tok.decode(new)


def describe_layout(dims: ParallelDims) -> str:
    return " x ".join(f"{name} {size}" for name, size in dims.named_dims()) or "single process"


def train(cfg: Config) -> dict:
    env = detect()
    device = init_distributed(env)
    dataset = load_dataset(cfg, env)
    args = cfg.model_args(dataset.vocab_size)
    validate(cfg, env.world_size, dataset.vocab_size)
    t = cfg.training
    torch.manual_seed(t.seed)

    dims = ParallelDims(world_size=env.world_size, dp_shard=env.world_size)
    dims.build_mesh(device.type)
    model = build_model(args, dims, t.seed, device)
    optimizer, scheduler = build_optimizer(model, cfg, device)
    loader = DistributedLoader(dataset.train, t.global_batch_size, dims.dp_rank, dims.dp, t.seed)
    val = validation_batches(dataset.val, t.eval_batches, t.global_batch_size, dims.dp_rank, dims.dp) \
        if len(dataset.val) else []
    autocast_dtype = torch.bfloat16 if t.dtype == "bf16" else None
    accum = grad_accum_steps(cfg, dims.dp)

    run_dir = Path(cfg.run.dir)
    is_rank0 = env.rank == 0
    log = MetricsLogger(run_dir, t.steps, is_rank0, cfg.run.tensorboard, cfg.run.progress)
    if is_rank0:
        write_resolved(cfg, run_dir, args)
        shutil.copyfile(dataset.tokenizer_path, run_dir / "tokenizer.json")
        log.print(
            f"meshtrain | {cfg.model.preset}: {num_params(model) / 1e6:.2f}M params | world {env.world_size} "
            f"({describe_layout(dims)}) | {device.type} {t.dtype} | global batch {t.global_batch_size} x "
            f"{t.seq_len} tokens (micro {t.micro_batch_size}, accumulation {accum}) | {t.steps} steps"
        )
        if not val:
            log.print(f"[yellow]warning: {dataset.val.path} holds less than one sequence; no validation loss")
    peak = device_peak_tflops(device, autocast_dtype or torch.float32, t.peak_tflops)
    meter = Throughput(flops_per_token(args, t.seq_len), peak, env.world_size)
    tokens_per_step = t.global_batch_size * t.seq_len
    history = []

    for step in range(1, t.steps + 1):
        inputs, targets = loader.next_batch()
        loss = forward_backward(model, inputs, targets, t.micro_batch_size, device, autocast_dtype)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or math.inf, foreach=True)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        meter.add(tokens_per_step)
        log.advance(step)

        metrics = {}
        if step % cfg.run.log_every == 0 or step in (1, t.steps):
            metrics = {"loss": mean_over(loss, dims.dp_group), "lr": lr, "grad_norm": grad_norm.item(),
                       **meter.report()}
        if val and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
            metrics["val_loss"] = evaluate(model, val, t.micro_batch_size, device, autocast_dtype, dims.dp_group)
        if metrics:
            log.log(step, metrics)
            history.append({"step": step, **metrics})

    state = full_state_dict(model)
    if is_rank0:
        if cfg.run.save_model:
            path = save_model(state, args, run_dir)
            log.print(f"saved the trained weights to {path}")
        if cfg.run.sample_prompt:
            text = sample_text(state, args, dataset.tokenizer_path, cfg.run.sample_prompt, cfg.run.sample_tokens,
                               dataset.eos_id)
            log.print("sample:\n" + text)
    log.close()
    return {"history": history}
