"""`meshtrain train --dry-run WORLD`: build what `train` builds for a job of WORLD ranks, as one
process on torch's fake process group, and measure the busiest ranks' memory without allocating it.

For each rank looked at (the first and the last pipeline stage's rank 0, or --dry-run-rank), the
process joins a fake process group as that rank of WORLD (a collective returns at once and moves
nothing), after the trainer's own job resolution (so a job the trainer refuses is refused here in the
same words), and runs the trainer's own `build_model`: the DeviceMesh, the model on the meta device,
`parallelize()` (TP/SP plans, FSDP2 groups, the pipeline split and schedule, DDP) and the optimizer
(with its ZeRO-1 partition), with every parameter materialised as a FakeTensor: shapes and dtypes,
no memory. Then it runs the
step on fake tensors and measures, with the trackers the planner's tests hold it to (`train.measure`):
  - model states: parameter, gradient and optimizer-state bytes this rank holds after a step (what
    a real run writes to memory.json);
  - activations: the bytes autograd saves during one micro-batch's forward (FSDP's all-gathered
    weights excluded: they are freed after use).
A pipeline rank runs its stages' forward and backward directly, one micro-batch each (torch 2.13's
schedules read a value during their warm-up, which fake tensors do not have), then the optimizer
step; its activations are one micro-batch's, measured, with the blocks' part times the micro-batches
the schedule keeps in flight. The working set and the peak ("other", "total") are the planner's.
A context-parallel job (parallel.cp) runs as built: the model keeps this rank's slice of each
sequence, and each attention's all-to-alls run through torch's functional collectives on the fake
process group (its alltoall_base returns at once, the output a fake tensor of the received shape).
A CPU-offload job (parallel.cpu_offload) is built without FSDP2's CPUOffloadPolicy, whose pinned
host memory has no fake tensor: the same shards, measured and planned as if they stayed on the GPU
(on the job's GPUs they are host memory, which `meshtrain plan` reports per node).
A QLoRA job (peft.method = qlora) keeps its base in bf16, as LoRA's: NF4 quantizes real weights
(train's load_base), not fake ones; a note says how much more that built than the NF4 planned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtrain.config import Config
from meshtrain.errors import MeshtrainError
from meshtrain.job import Job, check_dry_run, resolve_prepared
from meshtrain.job.device import check_device
from meshtrain.layout import Layout
from meshtrain.plan.request import Plan
from meshtrain.plan.workload import workload_of

KEYS = ("params", "grads", "optimizer", "activations", "other", "total")


@dataclass
class RankReport:
    rank: int
    coordinates: dict[str, int]
    built: dict[str, float]  # measured on fake tensors (keys of KEYS that were measured)
    planned: dict[str, float]  # the planner's prediction for this rank (KEYS)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "coordinates": self.coordinates,
            "built": self.built,
            "planned": self.planned,
            "notes": self.notes,
        }


def busiest_ranks(layout: Layout) -> list[int]:
    """Rank 0 of the first pipeline stage and of the last (they hold the embedding and the output:
    the largest shards); one rank without pipelining. (Every context-parallel rank of a sequence
    holds as much: Ulysses gives each the same slice of tokens and share of the heads.)"""
    pp_ranks = sorted({0, *(r for r in range(layout.pp) if layout.holds_last_stage(r))})
    return [pp_rank * (layout.world // layout.pp) for pp_rank in pp_ranks]


def dry_run(cfg: Config, world: int, ranks: list[int] | None = None) -> list[RankReport]:
    """The reports of `ranks` (default: the busiest) of a WORLD-rank job; the trainer's one-line
    error for a job it would refuse (the same resolution, word for word)."""
    job = resolve_prepared(cfg, world)
    check_dry_run(job, ranks or [])
    if cfg.launch.device in ("cpu", "cuda"):  # the device is fixed: what it must offer, as train checks it
        check_device(cfg, torch.device(cfg.launch.device), launcher=True)
    # "auto" arithmetic as the job's devices would resolve it: a GPU job (launch.device auto or cuda)
    # runs bf16 where its GPUs have bf16 units; a CPU job measures this host's CPU.
    job = job.on_device(torch.device("cpu" if cfg.launch.device == "cpu" else "cuda"), time_attention=False)
    return _in_children(_dry_run_rank, [(job, rank) for rank in ranks or busiest_ranks(job.layout)])


def _in_children(fn, calls: list[tuple]) -> list:
    """fn(*args) for each args in a forked process of its own (each rank joins its own fake process
    group, and torch keeps the groups and meshes of a destroyed one cached), as many at once as this
    host has cores: fake tensors do no arithmetic, each process is one core's Python. Results in
    order; the first error comes back as it was raised, after every process has ended."""
    width = os.cpu_count() or 1
    answers = []
    for first in range(0, len(calls), width):
        started = [_fork(fn, *args) for args in calls[first : first + width]]
        answers += [_answer(*child) for child in started]
    for _, error in answers:
        if error is not None:
            raise error
    return [result for result, _ in answers]


def _fork(fn, *args):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe(duplex=False)

    def run():
        try:
            child.send((fn(*args), None))
        except BaseException as e:  # sent back whole: a MeshtrainError keeps its one line
            try:
                child.send((None, e))
            except Exception:  # an error that does not pickle
                child.send((None, RuntimeError(f"{type(e).__name__}: {e}")))

    process = context.Process(target=run)
    process.start()
    child.close()  # so that a child that dies without answering ends the wait
    return process, parent


def _answer(process, parent) -> tuple:
    """(result, error) of a forked call, once its process has ended."""
    try:
        answer = parent.recv()
    except EOFError:
        process.join()
        return None, MeshtrainError(f"a dry-run process died (exit code {process.exitcode}): out of host memory?")
    process.join()
    return answer


def _dry_run_rank(job: Job, rank: int) -> RankReport:
    """`build_model` as `rank` of the job's fake process group, on fake tensors (on this CPU, whose
    kernels the planned figures are then of); then a step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.parallel.memory import model_state_bytes
    from meshtrain.plan.memory import rank_memory
    from meshtrain.train.build import build_model
    from meshtrain.train.step import step_context

    device, cfg, notes = torch.device("cpu"), job.cfg, []
    if job.layout.cpu_offload:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cpu_offload=False))
        job = dataclasses.replace(job, cfg=cfg, layout=dataclasses.replace(job.layout, cpu_offload=False))
        notes.append("cpu_offload: built without CPUOffloadPolicy (no fake pinned memory); the states are host memory")
    job = dataclasses.replace(job, device=device)
    args, layout = job.args, job.layout
    dist.init_process_group("fake", rank=rank, world_size=job.world, store=FakeStore())
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        _, model, optimizer, _, _ = build_model(job, materialize=fake)
        if job.lora is not None and job.lora.quantized:
            notes.append(_qlora_note(model))
        c = layout.coordinates(rank)
        workload = workload_of(job)
        report = RankReport(rank, c, {}, rank_memory(workload, layout, c["pp"]), notes)
        context = lambda: step_context(model, cfg.training, device)  # noqa: E731
        with fake, _no_gradient_sync(model):
            if model.schedule is None:
                _measure_step(model, optimizer, layout, cfg.training, context, report, args.vocab_size)
            else:
                _measure_stages(model, optimizer, layout, cfg.training, context, report, args, workload)
            report.built |= model_state_bytes(model.parameters(), optimizer)
        return report
    finally:
        dist.destroy_process_group()


def _qlora_note(model) -> str:
    """QLoRA's base is built as LoRA's, in bf16: NF4 quantizes real weights (train's load_base), not
    fake ones. What that adds to the built params and total, beside the NF4 bytes planned."""
    from meshtrain.model.lora import lora_modules
    from meshtrain.plan import nf4_bytes

    weights = [m.weight for part in model.parts for m in lora_modules(part)]
    built = sum(w.numel() * w.element_size() for w in weights)
    nf4 = sum(nf4_bytes(w.numel()) for w in weights)

    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    return (
        f"qlora: the base built in bf16 on fake tensors (NF4 quantizes real weights only), planned in NF4: its target "
        f"linears' {size(built)} are {size(nf4)} in NF4, so built params and total hold {size(built - nf4)} more "
        "than what runs"
    )


@contextlib.contextmanager
def _no_gradient_sync(model):
    """DDP's reducer cannot run on fake tensors; without it the gradients are the same tensors."""
    with contextlib.ExitStack() as stack:
        for part in model.parts:
            if hasattr(part, "no_sync"):
                stack.enter_context(part.no_sync())
        yield


def _tokens(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the right shape: the values do not matter to fake tensors."""
    return torch.zeros(batch, seq, dtype=torch.long), torch.ones(batch, seq, dtype=torch.long)


def _states(model, optimizer) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer's states: what a step starts with."""
    from meshtrain.optim import local_optimizer

    params = model.parameters()
    moments = [v for s in local_optimizer(optimizer).state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [*params, *(p.grad for p in params if p.grad is not None), *moments]


def _grad_bytes(model, optimizer) -> int:
    """The gradient bytes this rank holds after a step."""
    from meshtrain.parallel.memory import model_state_bytes

    return model_state_bytes(model.parameters(), optimizer)["grads"]


def _measure_step(model, optimizer, layout: Layout, t, context, report: RankReport, vocab: int) -> None:
    """One micro-batch's saved activations; then two training steps: the first (one micro-batch)
    makes the gradients and AdamW's moments, the second, which starts with them as every later
    step does, is the one whose peak of live bytes is measured. A sample is `rows_per_sample`
    sequences (DPO: a pair, with its reference pass), as the trainer's step takes it."""
    from meshtrain.train.measure import PeakLiveBytes, SavedActivations
    from meshtrain.train.step import micro_batch_loss, train_step

    (part,) = model.parts
    rows_per_sample = model.rows_per_sample
    x, y = _tokens(t.micro_batch_size * rows_per_sample, t.seq_len, vocab)
    with SavedActivations(part, fake=True) as saved, context():
        micro_batch_loss(model, part, x, y)
    report.built["activations"] = saved.bytes
    # Three micro-batches hold every state a step's memory passes through: the first makes the
    # gradients, a middle one adds to them without syncing, the last syncs (FSDP reduce-scatters).
    # Later middle ones repeat the second's peak, so a long accumulation is not run out on fake
    # tensors (8 micro-batches of Llama 3 8B took a minute). The loss keeps the job's scale.
    rows = min(t.global_batch_size // layout.dp, 3 * t.micro_batch_size) * rows_per_sample
    inputs, targets = _tokens(rows, t.seq_len, vocab)
    n_targets = t.global_batch_size * (1 if model.preference else t.seq_len)  # DPO's loss is a mean over pairs
    step = lambda x, y: train_step(model, optimizer, x, y, layout, t, torch.device("cpu"), context, None, n_targets)  # noqa: E731
    first = t.micro_batch_size * rows_per_sample
    step(inputs[:first], targets[:first])  # the gradients' and moments' first step
    with PeakLiveBytes(_states(model, optimizer)) as peak:
        step(inputs, targets)
    report.built["total"] = peak.peak
    if hasattr(part, "no_sync"):  # DDP ran under no_sync (its reducer cannot run on fake tensors)
        report.built["total"] += _grad_bytes(model, optimizer)
        report.notes.append("DDP: its gradient buckets (the gradients' size) added by rule")


def _measure_stages(model, optimizer, layout: Layout, t, context, report: RankReport, args, workload) -> None:
    """Each stage of this pipeline rank: one micro-batch forward (its saved bytes) and backward, then
    the optimizer step; twice, the second step's peak of live bytes measured."""
    from meshtrain.plan.memory import in_flight, resident_grad_bytes
    from meshtrain.train.measure import PeakLiveBytes

    _stages_step(model, optimizer, layout, t, context, args)
    with PeakLiveBytes(_states(model, optimizer)) as peak:
        whole, blocks = _stages_step(model, optimizer, layout, t, context, args)
    # The schedule holds the blocks' activations of several micro-batches at once (the embedding's
    # and the head's of one): the measured bytes of one, times the micro-batches in flight.
    flight = in_flight(layout, layout.micro_batches)
    report.built["activations"] = whole + blocks * (flight - 1)
    # ... and the gradients made by earlier micro-batches, where the schedule has a steady phase
    grads = resident_grad_bytes(workload, layout, report.coordinates["pp"], _grad_bytes(model, optimizer))
    report.built["total"] = peak.peak + blocks * (flight - 1) + grads
    report.notes.append(
        f"pipeline: one micro-batch's saved bytes and peak measured; x {flight:g} micro-batches in flight"
        + (" with the gradients of earlier ones" if grads else "")
        + " (the schedule's rule)"
    )


def _stages_step(model, optimizer, layout: Layout, t, context, args) -> tuple[int, int]:
    """One micro-batch through this rank's stages, forward and backward, and the optimizer step: the
    bytes the stages saved, and the part of them the transformer blocks saved."""
    from meshtrain.train.measure import SavedActivations

    mb = layout.micro_batch_size
    # what a stage receives from the one before: this rank's slice of the sequence under context
    # parallelism (the first stage and the loss take whole sequences), split over TP under sequence
    # parallelism
    seq_in = t.seq_len // layout.cp
    seq_in = seq_in // layout.tp if layout.tp > 1 and layout.sequence_parallel else seq_in
    whole = blocks = 0
    optimizer.zero_grad(set_to_none=True)
    for part in model.parts:
        first, last = part.tok_embeddings is not None, part.output is not None
        x = _tokens(mb, t.seq_len, args.vocab_size)[0] if first else torch.zeros(mb, seq_in, args.dim)
        x.requires_grad_(not first)
        with (
            SavedActivations(part, fake=True) as saved,
            _marking_blocks(part, saved) as marks,
            context(),
        ):
            out = part(x)
            if last:
                out = model.loss_fn(out, torch.ones(mb, t.seq_len, dtype=torch.long))
        whole += saved.bytes
        in_blocks = marks.get("end", set()) - marks.get("start", set())
        blocks += sum(n for key, n in saved.storages.items() if key in in_blocks)
        with context():
            out.backward(None if last else torch.zeros_like(out))
    optimizer.step()
    return whole, blocks


@contextlib.contextmanager
def _marking_blocks(part, saved):
    """The storages `saved` holds when the transformer blocks start and when they end (their
    difference: what the blocks saved)."""
    marks: dict[str, set[int]] = {}
    layers = list(part.layers.values())

    def mark(name: str):
        def hook(*_):  # returns None: the module's inputs and outputs stay as they are
            if name == "end" or name not in marks:
                marks[name] = set(saved.storages)

        return hook

    handles = []
    if layers:
        handles = [layers[0].register_forward_pre_hook(mark("start")), layers[-1].register_forward_hook(mark("end"))]
    try:
        yield marks
    finally:
        for handle in handles:
            handle.remove()


def verify(plan: Plan, arch: str, n: int) -> dict[int, dict]:
    """`plan --verify N`: the dry run of the best `n` layouts of a plan, each at its world size. Per
    layout, what the busiest built rank holds (GiB, None where the dry run does not measure it), beside
    the planner's figures for that rank and the kernels the dry run executed (`planned`), and the dry
    run's notes on where what it built is not what runs (a QLoRA base in bf16, CPU offload's states on
    the GPU, rules it added)."""
    if arch != "llama":
        raise MeshtrainError("--verify builds the layout with meshtrain's trainer, which trains Llama (--arch llama)")
    out = {}
    for i, e in enumerate(plan.estimates[:n]):
        job = e.layout.apply_to(plan.base)
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, vocab_size=plan.model.vocab_size))
        reports = dry_run(job, e.layout.world)
        busiest = max(reports, key=lambda r: sum(r.built.values()))

        def gib(values: dict) -> dict:
            return {k: round(values[k] / 2**30, 3) if values.get(k) is not None else None for k in KEYS}

        out[i] = {"rank": busiest.rank, **gib(busiest.built), "planned": gib(busiest.planned), "notes": busiest.notes}
    return out
