"""The training loop: who am I -> data -> model on the mesh -> step, log, evaluate -> save, sample.

One training step on each rank:
  loader.next_batch()            this DP rank's slice of the global batch (global / DP sequences)
  forward_backward()             micro-batches of training.micro_batch_size; DDP averages gradients
                                 on the last one (no_sync before), so global = micro x accum x DP
  global grad norm -> fused AdamW (clips and skips in its kernel) -> LR  (warm-up, cosine decay)
  every run.log_every steps      loss averaged over DP ranks, tokens/s, TFLOP/s, MFU -> rank 0 sinks
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import time
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshtrain.checkpoint import Checkpointer, find_resume, maybe_inject_failure, rng_state, set_rng_state
from meshtrain.config import Config, TrainingConfig, grad_accum_steps, parse_duration, validate, write_resolved
from meshtrain.errors import MeshtrainError
from meshtrain.data import Dataset, DistributedLoader, prepare, read_manifest, stdlib_sources, validation_batches
from meshtrain.launch import LaunchEnv, detect
from meshtrain.launch.local import PREEMPTED_EXIT_CODE
from meshtrain.metrics import MetricsLogger, Throughput, device_peak_tflops
from meshtrain.model import Llama, ModelArgs, flops_per_token, num_params
from meshtrain.parallel import ParallelDims, ParallelModel, arithmetic_dtype, parallelize
from meshtrain.parallel.data_parallel import average_gradients
from meshtrain.parallel.grads import global_grad_norm


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


def build_optimizer(params: list[torch.Tensor], cfg: Config, dims: ParallelDims, device: torch.device):
    """Fused AdamW (one kernel for all parameters; on CPU about 7x faster than foreach for the
    `small` preset), no weight decay on norms; with ZeRO-1 each DP rank keeps the states of its
    share of the parameters (ZeroRedundancyOptimizer)."""
    t = cfg.training
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norms
    ]
    kwargs = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True)
    if dims.zero == 1 and dims.dp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            process_group=dims.dp_group, **kwargs, weight_decay=t.weight_decay)
        optimizer.add_param_group(groups[1])
    else:
        optimizer = torch.optim.AdamW(groups, **kwargs)

    def lr_factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def step_context(model: ParallelModel, dims: ParallelDims, cfg: Config, device: torch.device) -> ExitStack:
    """Vocabulary-parallel loss under TP; autocast for bf16 unless FSDP casts the parameters itself."""
    stack = ExitStack()
    if dims.tp > 1 and cfg.parallel.loss_parallel:
        stack.enter_context(loss_parallel())
    if cfg.training.dtype == "bf16" and not model.fsdp:
        stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    return stack


def forward_backward(model: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int,
                     device: torch.device) -> torch.Tensor:
    """Gradients of this rank's local batch; returns its mean loss (a tensor: no host sync).
    Under PP the schedule splits the batch into micro-batches; otherwise gradients accumulate over
    them, with the DP gradient reduction only on the last."""
    if model.schedule is not None:
        loss = _pipeline_loss(model, inputs, targets, device, train=True)
        if model.grad_average_group is not None:
            average_gradients(model.parameters(), model.grad_average_group)
        return loss
    (part,) = model.parts
    chunks = list(zip(inputs.split(micro_batch), targets.split(micro_batch)))
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(chunks):
        last = i == len(chunks) - 1
        if hasattr(part, "set_requires_gradient_sync"):  # FSDP
            part.set_requires_gradient_sync(last)
        with nullcontext() if last or not hasattr(part, "no_sync") else part.no_sync():  # DDP
            loss = model.loss_fn(part(_to_device(x, device)), _to_device(y, device)) / len(chunks)
            loss.backward()
        total += local_value(loss.detach())
    return total


def train_step(model: ParallelModel, optimizer, inputs: torch.Tensor, targets: torch.Tensor,
               t: TrainingConfig, device: torch.device, context, pp_group=None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """forward/backward -> global grad norm -> AdamW, with no host-device sync.

    Clipping and skipping are folded into the fused AdamW kernel through the hooks GradScaler
    uses: it divides the gradients by `grad_scale` (max(1, norm / grad_clip): clipping without a
    separate pass over the gradients) and skips the update where `found_inf` is set (a non-finite
    norm). Returns tensors: (local mean loss, global grad norm, 1.0 if the update was skipped).
    Gradients are cleared at the start, so they can be inspected after the step."""
    optimizer.zero_grad(set_to_none=True)
    with context():
        loss = forward_backward(model, inputs, targets, t.micro_batch_size, device)
    grad_norm = global_grad_norm(model.parameters(), pp_group)
    skipped = (~torch.isfinite(grad_norm)).float()
    adamw = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the AdamW
    adamw.found_inf = skipped
    if t.grad_clip > 0:
        adamw.grad_scale = torch.clamp((grad_norm + 1e-6) / t.grad_clip, min=1.0)
    optimizer.step()
    return loss, grad_norm, skipped


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss_parallel) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _pipeline_loss(model: ParallelModel, inputs, targets, device, train: bool) -> torch.Tensor:
    """Run the schedule; the mean micro-batch loss on the rank with the last stage, else 0."""
    losses = [] if model.has_last_stage else None
    target = _to_device(targets, device) if model.has_last_stage else None
    args = (_to_device(inputs, device),) if model.has_first_stage else ()
    if train:
        model.schedule.step(*args, target=target, losses=losses)
    elif isinstance(model.schedule, ScheduleZBVZeroBubble):
        # ZBV's eval() fails in torch 2.13 ("stage doesn't have backward"): run a training step and
        # throw its gradients away (validation batches are few).
        with torch.enable_grad():
            model.schedule.step(*args, target=target, losses=losses)
        for part in model.parts:
            part.zero_grad(set_to_none=True)
    else:
        model.schedule.eval(*args, target=target, losses=losses)
    if not losses:
        return torch.zeros((), device=device)
    return torch.stack([local_value(loss.detach()).float() for loss in losses]).mean()


def reduce_loss(loss: torch.Tensor, dims: ParallelDims) -> float:
    """The global mean loss: from the last pipeline stage (sum over pp), averaged over DP."""
    if dims.pp > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=dims.mesh("pp").get_group())
    return mean_over(loss, dims.dp_group)


@torch.no_grad()
def evaluate(model: ParallelModel, batches, micro_batch: int, device: torch.device, dims: ParallelDims,
             context) -> float:
    for part in model.parts:
        part.eval()
    total = torch.zeros((), device=device)
    for inputs, targets in batches:
        with context():
            if model.schedule is not None:
                total += _pipeline_loss(model, inputs, targets, device, train=False)
                continue
            for x, y in zip(inputs.split(micro_batch), targets.split(micro_batch)):
                loss = model.loss_fn(model.parts[0](_to_device(x, device)), _to_device(y, device))
                total += local_value(loss) * len(x) / len(inputs)
    for part in model.parts:
        part.train()
    return reduce_loss(total / len(batches), dims)


def mean_over(value: torch.Tensor, group) -> float:
    """The mean of a scalar over a process group (every member must call this)."""
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value.item()


def full_state_dict(model: ParallelModel, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """The whole model's weights on global rank 0's CPU, from any layout (other ranks get {})."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.parts[0].state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dims.pp == 1:
        return get_model_state_dict(model.parts[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Each stage gathers its own weights, then the stages' first replicas send them to rank 0.
    state = {}
    for part in model.parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        state.update({k: v.detach().cpu() for k, v in full.items()})
    if dims.rank_in("dp") or dims.rank_in("tp"):
        return {}
    gathered = [None] * dims.pp if dist.get_rank() == 0 else None
    dist.gather_object(state, gathered, dst=0, group=dims.mesh("pp").get_group())
    return {k: v for stage in gathered for k, v in stage.items()} if gathered else {}


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
    names = {"dp_shard": "FSDP" if dims.zero >= 2 else "DDP", "dp_replicate": "replicate", "tp": "TP", "pp": "PP"}
    layout = " x ".join(f"{names[n]} {size}" for n, size in dims.named_dims()) or "single process"
    return f"{layout}, ZeRO-{dims.zero}" if dims.dp > 1 else layout


def report_memory(model: ParallelModel, optimizer, log: MetricsLogger) -> None:
    """Rank 0 prints every rank's parameter, gradient and optimizer-state bytes and its peak memory
    so far (host RSS; on a GPU also the allocator's peak), after the first step (a collective)."""
    from meshtrain.parallel.memory import model_state_bytes, peak_memory_bytes

    mine = {**model_state_bytes(model.parameters(), optimizer), **peak_memory_bytes()}
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    mib = 2**20
    for rank, b in enumerate(ranks):
        log.print(f"rank {rank}: params {b['params'] / mib:8.2f} MiB | grads {b['grads'] / mib:8.2f} MiB | "
                  f"optimizer {b['optimizer'] / mib:8.2f} MiB | peak RSS {b['peak_rss'] / mib:8.1f} MiB"
                  + (f" | peak GPU {b['peak_gpu'] / mib:8.1f} MiB" if "peak_gpu" in b else ""))
    log.write_json("memory.json", ranks)




class StopSignals:
    """SIGTERM / SIGUSR1 (Slurm's --signal=USR1@90) only set a flag: every rank finishes its step,
    then all agree (a MAX all-reduce) to checkpoint and exit together."""

    def __init__(self):
        self.received = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum


def agree(signals: StopSignals, deadline: float, step_time: float, ckpt: Checkpointer) -> tuple[bool, bool, bool]:
    """(preempted, out of time, async save finished everywhere), agreed over all ranks with one
    small all-reduce per step, of a CPU tensor (gloo), so the device is never waited on. Out of
    time: the next step and a save (estimated as two steps) would not fit before the deadline."""
    flags = torch.tensor([float(signals.received != 0),
                          float(deadline > 0 and time.monotonic() + 3 * step_time > deadline),
                          float(ckpt.pending is not None and not ckpt.pending[0].done())])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1]), ckpt.pending is not None and not flags[2]


def train(cfg: Config) -> dict:
    """Returns {"history": logged metrics, "exit_code": 0, or PREEMPTED_EXIT_CODE}."""
    start_time = time.monotonic()
    signals = StopSignals()
    env = detect(launcher=cfg.launch.env)
    device = init_distributed(env)
    dataset = load_dataset(cfg, env)
    args = cfg.model_args(dataset.vocab_size)
    validate(cfg, env.world_size, dataset.vocab_size)
    t = cfg.training
    torch.manual_seed(t.seed)

    dims = ParallelDims.from_config(cfg.parallel, env.world_size)
    dims.build_mesh(device.type)
    with torch.device("meta"):
        full_model = Llama(args)
    model = parallelize(full_model, dims, cfg.parallel, t, device, cross_entropy)
    optimizer, scheduler = build_optimizer(model.parameters(), cfg, dims, device)
    loader = DistributedLoader(dataset.train, t.global_batch_size, dims.dp_rank, dims.dp, t.seed)
    val = validation_batches(dataset.val, t.eval_batches, t.global_batch_size, dims.dp_rank, dims.dp) \
        if len(dataset.val) else []
    accum = grad_accum_steps(cfg, dims.dp)
    context = lambda: step_context(model, dims, cfg, device)  # noqa: E731
    pp_group = dims.mesh("pp").get_group() if dims.pp > 1 else None
    compute_dtype = arithmetic_dtype(t, device)
    fp32_arithmetic = t.dtype == "bf16" and compute_dtype == torch.float32
    precision = f"{t.dtype}{' (fp32 arithmetic)' if fp32_arithmetic else ''}"

    run_dir = Path(cfg.run.dir)
    is_rank0 = env.rank == 0
    log = MetricsLogger(run_dir, t.steps, is_rank0, cfg.run.tensorboard, cfg.run.progress)
    if is_rank0:
        write_resolved(cfg, run_dir, args)
        shutil.copyfile(dataset.tokenizer_path, run_dir / "tokenizer.json")
        log.print(
            f"meshtrain | {cfg.model.preset}: {num_params(full_model) / 1e6:.2f}M params | world {env.world_size} "
            f"({describe_layout(dims)}) | {device.type} {precision} | global batch {t.global_batch_size} x "
            f"{t.seq_len} tokens (micro {t.micro_batch_size} x {accum}"
            f"{' pipeline micro-batches' if dims.pp > 1 else ' accumulation'}) | {t.steps} steps"
        )
        for line in dims.describe_groups():
            log.print("  " + line)
        if not val:
            log.print(f"[yellow]warning: {dataset.val.path} holds less than one sequence; no validation loss")

    layout = {"world_size": env.world_size, "tp": dims.tp, "pp": dims.pp, "dp_replicate": dims.dp_replicate,
              "dp_shard": dims.dp_shard, "zero": dims.zero}
    model_shape = dataclasses.asdict(args)
    ckpt = Checkpointer(Path(cfg.checkpoint.dir or run_dir / "checkpoints"), model.parts, optimizer,
                        cfg.checkpoint.keep, cfg.checkpoint.async_, env.rank)
    start_step, skipped = 0, 0  # skipped: updates skipped for a non-finite gradient norm
    resume_from = find_resume(cfg.checkpoint.resume, ckpt.root, lambda m: log.print(f"[yellow]warning: {m}"))
    if resume_from is None and cfg.model.init_from:
        from meshtrain.interop import load_hf_weights

        load_hf_weights(model.parts, cfg.model.init_from.removeprefix("hf:"), args)
        log.print(f"initialised from {cfg.model.init_from}")
    if resume_from is not None:
        state = ckpt.load(resume_from, model_shape)
        start_step, skipped = state["step"], state.get("skipped_steps", 0)
        loader.load_state_dict(state["loader"])
        scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        set_rng_state(state["rng"])
        log.print(f"resumed from {resume_from} (step {start_step}, saved with {state['layout']})")

    def save(step: int, blocking: bool = False) -> None:
        ckpt.save(step, {"step": step, "skipped_steps": int(skipped_total.item()), "loader": loader.state_dict(),
                         "scheduler": scheduler.state_dict(), "rng": rng_state(), "layout": layout,
                         "model": model_shape}, blocking=blocking)

    peak = device_peak_tflops(device, compute_dtype, t.peak_tflops)  # MFU of the arithmetic the step runs
    meter = Throughput(flops_per_token(args, t.seq_len), peak, env.world_size)
    tokens_per_step = t.global_batch_size * t.seq_len
    deadline = start_time + parse_duration(t.time_limit, "training.time_limit") if t.time_limit else 0.0
    last_step = t.stop_at_step or t.steps
    history, exit_code, step_time, step = [], 0, 0.0, start_step
    skipped_total, reported_skips = torch.tensor(float(skipped), device=device), skipped

    for step in range(start_step + 1, last_step + 1):
        maybe_inject_failure(step)
        step_start = time.monotonic()
        inputs, targets = loader.next_batch()
        lr = scheduler.get_last_lr()[0]
        loss, grad_norm, skipped_now = train_step(model, optimizer, inputs, targets, t, device, context, pp_group)
        skipped_total += skipped_now
        if t.on_nonfinite == "stop" and skipped_now.item():  # the one mode that syncs every step
            raise MeshtrainError(f"step {step}: the loss or gradient norm is not finite ({grad_norm.item()}); "
                                 "lower training.lr, check the data, or set training.on_nonfinite = skip")
        if step == start_step + 1:  # gradients and optimizer states exist now
            report_memory(model, optimizer, log)
        scheduler.step()
        meter.add(tokens_per_step)
        log.advance(step)

        metrics = {}
        if step % cfg.run.log_every == 0 or step in (start_step + 1, last_step):
            skipped = int(skipped_total.item())
            if skipped > reported_skips:
                log.print(f"[yellow]step {step}: {skipped - reported_skips} step(s) skipped since the last log "
                          f"(non-finite gradient norm; {skipped} in all)")
                reported_skips = skipped
            metrics = {"loss": reduce_loss(loss, dims), "lr": lr, "grad_norm": grad_norm.item(),
                       "skipped_steps": skipped, **meter.report()}
        if val and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
            metrics["val_loss"] = evaluate(model, val, t.micro_batch_size, device, dims, context)
        if metrics:
            log.log(step, metrics)
            history.append({"step": step, **metrics})

        if os.environ.get("MESHTRAIN_TEST_STEP_SLEEP"):  # lets tests signal a run mid-way
            time.sleep(float(os.environ["MESHTRAIN_TEST_STEP_SLEEP"]))
        step_time = max(step_time, time.monotonic() - step_start)
        preempted, out_of_time, save_finished = agree(signals, deadline, step_time, ckpt)
        if save_finished:
            ckpt.wait()  # commit the async checkpoint now that every rank has written it
        if preempted or out_of_time or step == t.stop_at_step:
            save(step, blocking=True)
            reason = "preempted" if preempted else "time limit reached" if out_of_time else "training.stop_at_step"
            log.print(f"{reason}: checkpoint of step {step} saved in {ckpt.root}; run again to continue")
            exit_code = PREEMPTED_EXIT_CODE if preempted else 0
            break
        if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or (cfg.checkpoint.every and step == t.steps):
            save(step)
    ckpt.wait()

    if step == t.steps and not exit_code:
        state = full_state_dict(model, dims)
        if is_rank0:
            if cfg.run.save_model:
                path = save_model(state, args, run_dir)
                log.print(f"saved the trained weights to {path}")
            if cfg.run.sample_prompt:
                text = sample_text(state, args, dataset.tokenizer_path, cfg.run.sample_prompt, cfg.run.sample_tokens,
                                   dataset.eos_id)
                log.print("sample:\n" + text)
    log.close()
    return {"history": history, "exit_code": exit_code}
