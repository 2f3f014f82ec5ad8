"""The training loop: build -> resume -> for each step: step, log, evaluate, agree on stopping,
checkpoint -> the trained weights and a sample. What one step does is in train/step.py; what it
runs on is built in train/build.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.checkpoint import (
    checkpoint_root,
    committed_checkpoints,
    continue_job,
    find_resume,
    job_locks,
    refuse_another_lineage,
    refuse_overwriting_results,
)
from meshtrain.checkpoint.checkpointer import Checkpointer
from meshtrain.config import Config, parse_duration, resolved, to_toml
from meshtrain.config.checks import check_steps_ahead
from meshtrain.data.tokenizer import copy_tokenizer
from meshtrain.errors import MeshtrainError
from meshtrain.files import ensure_room, write_json, write_text
from meshtrain.hardware import mfu_peak_floor, mfu_peak_tflops
from meshtrain.interop.hf_import import keep_source_files
from meshtrain.launch import detect
from meshtrain.launch.distributed import agreed
from meshtrain.launch.local import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from meshtrain.lock import JobLocks
from meshtrain.logs import log, setup_logging
from meshtrain.metrics import MetricsLogger, Throughput
from meshtrain.model.moe import balance_report
from meshtrain.optim import restore_schedule
from meshtrain.parallel import arithmetic_label
from meshtrain.parallel.memory import format_memory, gather_memory_report
from meshtrain.train.base import check_same_base, load_base, peft_record, reference_record
from meshtrain.train.build import TrainState, build, warn_pointless_settings
from meshtrain.train.preference import DEFAULT_BETA
from meshtrain.train.step import evaluate, reduce_loss
from meshtrain.train.stragglers import StragglerDetector, compute_timer
from meshtrain.train.watchdog import Watchdog, main_thread_io, phase


class StopSignals:
    """SIGTERM, SIGUSR1 (Slurm's --signal=USR1@90), SIGHUP, SIGQUIT and SIGINT (Ctrl-C) only set a
    flag: every rank finishes its step, then all agree (a MAX all-reduce) to checkpoint and exit
    together, with 130 after SIGINT and 75 (preempted) after the others. A second Ctrl-C stops at once.

    Installed only once the job is built: until then there is nothing to save, and a signal must end
    the process at once (its default action). A rank that only set a flag would go on into the next
    rendezvous or store wait of the start-up and sit there for the process group's timeout (minutes)
    when a peer that took the same signal before its handlers existed has already died."""

    def __init__(self):
        self.received = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT_CODE if self.received == signal.SIGINT else PREEMPTED_EXIT_CODE


def agree(signals: StopSignals, deadline: float, step_time: float, ckpt: Checkpointer) -> tuple[bool, bool, bool]:
    """(preempted, out of time, async save finished everywhere), agreed over all ranks with one
    small all-reduce per step, of a CPU tensor (gloo), so the device is never waited on. Out of
    time: the next step and a save (estimated as two steps) would not fit before the deadline."""
    flags = torch.tensor(
        [
            float(signals.received != 0),
            float(deadline > 0 and time.monotonic() + 3 * step_time > deadline),
            float(ckpt.pending is not None and not ckpt.pending[0].done()),
        ]
    )
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1]), ckpt.pending is not None and not flags[2]


def record_run(s: TrainState) -> None:
    """The run's record: its config as given with the model's shape spelled out, what "auto" resolved
    to (arithmetic.json), its tokenizer (and template) and the pretrained model's files, for serve and
    export. Written once the start is known to go ahead, so that a
    refused resume (another base, shape or step count) leaves the record of the run as it was."""
    run_dir = Path(s.cfg.run.dir)
    write_text(run_dir / "config.toml", to_toml(resolved(s.job.given or s.cfg, s.args)))
    write_json(
        run_dir / "arithmetic.json",
        dataclasses.asdict(s.job.arithmetic) | {"attention_backward": dataclasses.asdict(s.job.attention)},
    )
    copy_tokenizer(s.dataset.tokenizer_path, run_dir, s.dataset.template_path)
    if s.cfg.model.init_from:  # the pretrained model's config, tokenizer files and end tokens, for export
        keep_source_files(s.cfg.model.init_from.removeprefix("hf:"), run_dir)


def announce(s: TrainState) -> None:
    t = s.cfg.training
    log.info(
        f"meshtrain | {s.cfg.model.source()}: {s.n_params / 1e6:.2f}M params | world {s.env.world_size} "
        f"({s.dims.describe()}) | {s.device.type} {s.job.arithmetic.name} | global batch {t.global_batch_size} x "
        f"{t.seq_len} tokens (micro {t.micro_batch_size} x {s.layout.micro_batches}"
        f"{' pipeline micro-batches' if s.layout.pp > 1 else ' accumulation'}) | {t.steps} steps"
    )
    log.info(f"  arithmetic: {s.job.arithmetic.describe()}")
    log.info(f"  attention backward: {s.job.attention.describe()}")
    if t.cuda_graphs:
        log.info("  CUDA graphs: the compiled model's forward and backward each replay as one launch")
    if s.lora is not None:
        from meshtrain.model.lora import adapter_count

        trains = adapter_count(s.job.shape, s.lora)
        base = "4-bit NF4" if s.lora.quantized else "frozen"
        log.info(
            f"  {s.lora.method}: rank {s.lora.rank}, alpha {s.lora.alpha:g} on {', '.join(s.lora.targets)}: "
            f"{trains / 1e6:.2f}M trainable parameters ({100 * trains / s.n_params:.2f}%), the base {base}"
        )
    if t.objective == "dpo":
        log.info(f"  DPO, beta {t.dpo_beta or DEFAULT_BETA}: batch sizes count preference pairs (two sequences each)")
    for line in s.dims.describe_groups():
        log.info("  " + line)
    warn_pointless_settings(s)


def validation_losses(s: TrainState) -> dict:
    """val_loss: the blend's weights over its sources' losses (one source: its loss); for a blend
    also val_loss_by_source; for DPO the held-out pairs' rewards and preference accuracy."""
    preference = s.model.preference
    training_sums = preference.sums.clone() if preference else None
    losses = {name: evaluate(s.model, batches, s.device, s.dims, s.context) for name, batches in s.val.items()}
    weights = dict(zip(s.dataset.names, s.dataset.weights))
    total = sum(weights[name] for name in losses)
    record = {"val_loss": sum(weights[name] * loss for name, loss in losses.items()) / total}
    if preference:  # DPO: the rewards of the held-out pairs (over all sources), apart from training's
        record |= {f"val_{key}": value for key, value in preference.report(s.dims.dp_group).items()}
        preference.sums.copy_(training_sums)
    if len(s.dataset.sources) > 1:
        record["val_loss_by_source"] = losses
    return record


def resume(s: TrainState) -> tuple[int, int]:
    """(steps done, updates skipped so far) from the checkpoint to resume, or a fresh start. With
    LoRA the checkpoint holds the adapters only: the base is loaded (and quantized) first, as at
    the start, and must be the one the adapters were trained on."""
    ckpt = s.checkpointer
    results = Path(s.cfg.run.dir) / "model.safetensors"
    path = find_resume(s.cfg.checkpoint.resume, ckpt.root, log.warning, retire_skipped=True, results=results)
    if path is not None:
        check_same_base(s, path)
    if path is None or s.lora is not None or s.model.reference is not None:
        load_base(s, into_model=path is None or s.lora is not None)
    if path is None:
        return 0, 0
    with phase.of("load", progress=main_thread_io):
        state = ckpt.load(path, dataclasses.asdict(s.args))
    s.loader.load_state_dict(state["loader"])
    restore_schedule(s.scheduler, state["scheduler"])
    if s.scaler is not None and "loss_scale" in state:
        s.scaler.load_state_dict(state["loss_scale"])
        log.info(
            f"fp16 loss scale {s.scaler.factor().item():g} continues from the checkpoint "
            "(training.initial_loss_scale is where a new run starts)"
        )
    elif s.scaler is not None or "loss_scale" in state:  # the precision changed between runs: a fresh scale
        log.info(
            "the checkpoint was saved without fp16's loss scale: it starts at training.initial_loss_scale"
            if s.scaler is not None
            else f"the checkpoint's fp16 loss scale is not used: this run trains in {s.cfg.training.dtype}"
        )
    log.info(f"resumed from {path} (step {state['step']}, saved with {state['layout']})")
    return state["step"], state.get("skipped_steps", 0)


def save(s: TrainState, step: int, skipped: int, blocking: bool = False) -> None:
    d = s.layout
    layout = {
        "world_size": s.env.world_size,
        "tp": d.tp,
        "pp": d.pp,
        "cp": d.cp,
        "dp_replicate": d.dp_replicate,
        "dp_shard": d.dp_shard,
        "zero": d.zero,
        "ep": d.ep,
    }
    with phase.of("save", progress=s.checkpointer.written_bytes):
        s.checkpointer.save(
            step,
            {
                "step": step,
                "skipped_steps": skipped,
                "loader": s.loader.state_dict(),
                "scheduler": s.scheduler.state_dict(),
                "layout": layout,
                "model": dataclasses.asdict(s.args),
                "peft": peft_record(s),
                "init_from": s.base.get("init_from"),
                "reference": reference_record(s),
                "run_dir": str(Path(s.cfg.run.dir).resolve()),  # where export and serve find the run's tokenizer
                **({"loss_scale": s.scaler.state_dict()} if s.scaler is not None else {}),
            },
            blocking=blocking,
        )


def warn_skips(step: int, skipped: int, reported: int, loss_scale: float | None) -> int:
    if skipped > reported:
        why = "non-finite gradient norm" if loss_scale is None else f"fp16 overflow: loss scale now {loss_scale:g}"
        log.warning(f"step {step}: {skipped - reported} step(s) skipped since the last log ({why}; {skipped} in all)")
    return skipped


def check_trained(s: TrainState, step: int, ran: int, skipped: int, trailing: int) -> None:
    """A run that trained nothing fails here, before its weights are written as "trained", saying
    what to change: no step of it applied, the last half or more of its steps all skipped (an update
    broke the weights: from then on every loss is NaN or infinite), or weights that are not finite.
    One with some skipped steps says how many. Every rank agrees: the counts are global."""
    fp16 = s.scaler is not None
    why = "overflowed fp16's loss scale" if fp16 else "had a loss or gradient norm that was not finite"
    fix = (
        "lower training.initial_loss_scale or training.lr, or train in bf16"
        if fp16
        else "lower training.lr, or check the data and the model's config (model.init_from's config.json)"
    )
    if ran and skipped == ran:
        raise MeshtrainError(f"no step of this run was applied: each of its {ran} steps {why}; {fix}")
    if trailing >= 2 and 2 * trailing >= ran:
        raise MeshtrainError(
            f"training stopped learning at step {step - trailing}: each of the {trailing} steps after it {why} "
            f"(of this run's {ran}); {fix}"
        )
    broken = torch.zeros((), device=s.device)
    for p in local_trainable(s.model.parameters()):
        broken += (~torch.isfinite(p.detach())).sum().to(broken.device)
    if dist.is_initialized():
        dist.all_reduce(broken)
    if broken.item():
        raise MeshtrainError(
            f"the trained weights are not finite at step {step} ({int(broken.item()):,} values are NaN or "
            "infinite: an update overflowed them); lower training.lr or raise training.warmup_steps"
        )
    if skipped:
        log.warning(f"{skipped} of this run's {ran} steps were skipped: each {why}")


def local_trainable(parameters):
    """This rank's values of each trained parameter, as a plain tensor (a DTensor's local shard, what
    an FP8 training wrapper holds: their ops stop at casts); FP8 bytes are no master weights."""
    for p in parameters:
        if p.requires_grad:
            t = p.detach()
            while hasattr(t, "__tensor_flatten__"):
                t = getattr(t, t.__tensor_flatten__()[0][0])
            if t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):  # not a cast's fp8 bytes
                yield t


def report_memory(s: TrainState, metrics: MetricsLogger, quiet: bool = False) -> None:
    """Every rank's parameter, gradient and optimizer bytes and peak memory: logged (unless `quiet`)
    and written to memory.json."""
    report = gather_memory_report(s.model.parameters(), s.optimizer)
    if quiet:
        metrics.write_json("memory.json", report)
        return
    for rank, line in enumerate(report):
        log.info(format_memory(rank, line))
    if s.cfg.run.plan_check:
        from meshtrain.train.plan_check import compare

        for line in compare(s.job, report):
            log.info(line)
    metrics.write_json("memory.json", report)


def finish(s: TrainState, step: int, skipped: int) -> None:
    """The trained weights: gathered into model.safetensors when the model is small enough, else
    the last checkpoint (saved now if the schedule did not) is what `meshtrain export` reads."""
    from meshtrain.interop.weights import full_state_dict, model_bytes, save_model

    run = s.cfg.run
    if not (run.save_model or run.sample_prompt):
        return
    if model_bytes(s.n_params) > run.save_model_max_gb * 1e9:
        if run.save_model:
            if not s.cfg.checkpoint.every:  # else the loop saved this step already
                save(s, step, skipped, blocking=True)
            log.info(
                f"the model is above run.save_model_max_gb = {run.save_model_max_gb}: its weights are the "
                f"checkpoint in {s.checkpointer.root}; `meshtrain export {run.dir} --out DIR` writes them out"
            )
        if run.sample_prompt:  # sampling needs the whole model in one process, as saving it does
            log.info(
                f"run.sample_prompt: no sample, the model is above run.save_model_max_gb = {run.save_model_max_gb}; "
                f"`meshtrain generate {run.dir} --prompt ...` samples from its checkpoint"
            )
        return
    state = full_state_dict(s.model, s.dims)
    if s.env.rank != 0:
        return
    if run.save_model:
        committed = committed_checkpoints(s.checkpointer.root)
        try:
            ensure_room(run.dir, model_bytes(s.n_params), "the trained weights")
            saved, state = save_model(state, s.args, Path(run.dir), peft_record(s), step=step)
            log.info(f"saved the trained weights to {saved}")
        except MeshtrainError as e:
            kept = (
                f"; the checkpoint {committed[-1]} holds them: `meshtrain export` writes them out" if committed else ""
            )
            raise MeshtrainError(f"{e}{kept}") from None
    elif s.lora is not None:  # what the saved weights would be: the adapters merged into the base
        from meshtrain.interop.base import merged_onto_base

        state = merged_onto_base(state, s.args, peft_record(s))
    if run.sample_prompt and log.isEnabledFor(20):  # logging.INFO: the default sample, unseen at a quieter level
        from meshtrain.serve import sample_text

        log.info(
            "sample:\n" + sample_text(state, s.args, s.dataset.tokenizer_path, run.sample_prompt, run.sample_tokens)
        )


def hold_run_dir(cfg: Config, rank: int) -> JobLocks:
    """Before anything is written: the run directory's lock (rank 0 takes it, or finds it held by
    the launcher of this job) and a fresh start that would mix lineages refused; every rank raises
    the same one-line error."""
    lock = job_locks(cfg)
    error = None
    if rank == 0:
        try:
            lock.acquire()
            refuse_another_lineage(cfg.checkpoint.resume, checkpoint_root(cfg))
            if lock.held:  # taken now, not held by this job's launcher or an earlier start of it
                refuse_overwriting_results(cfg.checkpoint.resume, checkpoint_root(cfg), Path(cfg.run.dir))
        except MeshtrainError as e:
            lock.release()
            error = e
    error = agreed(error)
    if error is not None:
        raise error
    return lock


def train(cfg: Config) -> dict:
    """Returns {"history": logged metrics, "exit_code": 0, PREEMPTED_EXIT_CODE or INTERRUPTED_EXIT_CODE}
    (a hung job's ranks exit HANG_EXIT_CODE from their watchdog, train/watchdog.py)."""
    start_time = time.monotonic()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C in start-up: out at once, even from a C++ wait
    env = detect(launcher=cfg.launch.env)
    setup_logging(env.rank, cfg.run.log_level)
    cfg = continue_job(cfg)
    s = build(cfg, env)
    lock = hold_run_dir(cfg, env.rank)
    try:
        with start_watchdog(s) as watchdog:
            return _train(s, s.cfg, env, start_time, StopSignals(), watchdog)  # "auto" resolved
    finally:
        lock.release()


def start_watchdog(s: TrainState) -> Watchdog:
    """Every rank's watchdog, knowing every rank's host and pid and a name for this start of the job."""
    peers: list = [(socket.gethostname(), os.getpid())]
    if dist.is_initialized():
        peers = [None] * s.env.world_size
        dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    attempt = agreed(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    timeouts = (s.cfg.training.hang_timeout, s.cfg.training.first_step_timeout)
    return Watchdog(
        s.cfg.run.dir, s.env.rank, s.env.world_size, timeouts, peers, attempt, s.device.type, s.checkpointer.root
    )


def log_record(s: TrainState, step: int, lr: float, loss, grad_norm, n_targets, meter, detector) -> dict:
    """The metrics of a logged step (every rank calls this: the loss and compute times are reduced)."""
    preference = s.model.preference
    return {
        "loss": reduce_loss(loss, s.dims),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        # of this step's global batch: target tokens (chat data: the loss mask's), or DPO's pairs
        "pairs" if preference else "target_tokens": n_targets,
        **(preference.report(s.dims.dp_group) if preference else {}),
        **(balance_report(s.model.parts, s.balance_groups) if s.moe else {}),
        **meter.report(),
        **detector.report(),
    }


def _train(s: TrainState, cfg: Config, env, start_time: float, signals: StopSignals, watchdog: Watchdog) -> dict:
    t, ckpt = cfg.training, s.checkpointer
    if env.rank == 0:
        announce(s)
    start_step, skipped = resume(s)
    check_steps_ahead(start_step, t)
    if env.rank == 0:
        record_run(s)
    metrics = MetricsLogger(
        Path(cfg.run.dir), t.steps, env.rank == 0, cfg.run.tensorboard, cfg.run.progress, start_step
    )
    meter = Throughput(
        s.job.shape.flops_per_token(t.seq_len, s.lora, t.objective == "dpo"),
        mfu_peak_tflops(s.device, t.dtype, t.peak_tflops, t.fp8),
        env.world_size,
        mfu_peak_floor(s.device, t.dtype, t.peak_tflops),
    )
    timer = compute_timer(s.model.parts, s.device, s.layout, t.compile, env.world_size)
    detector = StragglerDetector(timer, s.device, env.world_size)
    arithmetic = arithmetic_label(t)
    deadline = start_time + parse_duration(t.time_limit, "training.time_limit") if t.time_limit else 0.0
    last_step = t.stop_at_step or t.steps
    history, exit_code, step_time, step = [], 0, 0.0, start_step
    skipped_total, reported_skips = torch.tensor(float(skipped), device=s.device), skipped
    trailing_skips = torch.zeros((), device=s.device)  # skipped steps since the last applied one

    for step in range(start_step + 1, last_step + 1):
        step_start = time.monotonic()
        lr = s.scheduler.get_last_lr()[0]
        phase("data", step)
        data_start = time.perf_counter()
        inputs, targets, positions, n_targets = s.loader.next_batch()
        timer.add(time.perf_counter() - data_start)
        phase("forward/backward")
        loss, grad_norm, skipped_now = s.step(inputs, targets, n_targets, positions)
        phase("logging")
        skipped_total += skipped_now
        trailing_skips = (trailing_skips + skipped_now) * skipped_now
        # the one mode that syncs every step; under fp16 an overflow is the loss scaler's to skip,
        # until the scale has fallen below 1 (then no scale is to blame)
        if (
            t.on_nonfinite == "stop"
            and (skipped_now if s.scaler is None else skipped_now * (s.scaler.factor() < 1)).item()
        ):
            raise MeshtrainError(
                f"step {step}: the loss or gradient norm is not finite ({grad_norm.item()}); "
                "lower training.lr, check the data, or set training.on_nonfinite = skip"
            )
        if step in (start_step + 1, start_step + 2):  # states exist now; then the peak of a step with them
            report_memory(s, metrics, quiet=step == start_step + 2)
        s.scheduler.step()
        meter.add(t.global_batch_size * s.model.rows_per_sample * t.seq_len)
        metrics.advance(step)

        record = {}
        if step % cfg.run.log_every == 0 or step in (start_step + 1, last_step):
            record = log_record(s, step, lr, loss, grad_norm, n_targets, meter, detector)
            record |= {"skipped_steps": int(skipped_total.item()), "arithmetic": arithmetic}
            if s.scaler is not None:
                record["loss_scale"] = s.scaler.factor().item()
            reported_skips = warn_skips(step, record["skipped_steps"], reported_skips, record.get("loss_scale"))
        if s.val and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
            phase("evaluation")
            record.update(validation_losses(s))
        if record:
            record["data_mix"] = dict(zip(s.dataset.names, s.loader.mix()))
            metrics.log(step, record)
            history.append({"step": step, **record})

        phase("checkpoint")
        step_time = max(step_time, time.monotonic() - step_start)
        preempted, out_of_time, save_finished = agree(signals, deadline, step_time, ckpt)
        if save_finished:
            with phase.of("save", progress=ckpt.written_bytes):
                ckpt.wait()  # commit the async checkpoint now that every rank has written it
        if preempted or out_of_time or step == t.stop_at_step:
            save(s, step, int(skipped_total.item()), blocking=True)
            stopped = "interrupted" if signals.exit_code == INTERRUPTED_EXIT_CODE else "preempted"
            reason = stopped if preempted else "time limit reached" if out_of_time else "training.stop_at_step"
            log.info(f"{reason}: checkpoint of step {step} saved in {ckpt.root}; run again to continue")
            exit_code = signals.exit_code if preempted else PREEMPTED_EXIT_CODE if out_of_time else 0
            break
        if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == t.steps):
            save(s, step, int(skipped_total.item()))
        watchdog.first_step_done()
    with phase.of("save", progress=ckpt.written_bytes):
        ckpt.wait()
    if not exit_code:
        check_trained(s, step, step - start_step, int(skipped_total.item()) - skipped, int(trailing_skips.item()))
    if step == t.steps and not exit_code:
        finish(s, step, int(skipped_total.item()))
    metrics.close()
    return {"history": history, "exit_code": exit_code}
