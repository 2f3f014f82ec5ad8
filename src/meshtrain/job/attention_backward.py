"""Which backward attention runs: `training.attention_backward = "auto"`, resolved once at start.

On a CPU, torch's flash-attention backward kernel is slow at short sequences, and recomputing the
scores from matmuls (model/recompute_attention.py) can be faster, but only compiled (eagerly its
elementwise work is not fused: 3x slower than the kernel for `small` on a Xeon with AMX) and only at
some shapes and arithmetics (same machine, compiled, forward + backward of one layer's attention,
ms: 8 x 256 tokens, 10 heads of 64 over 5, bf16 kernel 26 / recomputed 15, fp32 21 / 29; 2 x 1024
tokens, bf16 36 / 47). So on a CPU with training.compile the probe compiles both at the run's own
attention shape (micro-batch rows, two a DPO pair; local heads, seq, head_dim) and arithmetic, times
forward + backward in interleaved rounds, and takes the recomputation only where it is faster by
more than MARGIN. Timed like job/arithmetic.py's probe (CPU time on one thread, the second-fastest
of each, a busy machine's record not reused) and cached beside it. Elsewhere: the flash kernel (GPUs
keep theirs).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.hardware import cached_measurement, cpu_model
from meshtrain.job.probe_timing import BUSY, OtherLoad, own_code, quiet_record, timed_ms
from meshtrain.launch.distributed import agreed
from meshtrain.layout import Layout
from meshtrain.model.args import ModelArgs
from meshtrain.model.recompute_attention import MAX_SCORES, recomputed_attention
from meshtrain.parallel.precision import fp32_classes

MARGIN = 0.05  # the recomputation must time this much faster than the kernel
ROUNDS = 4  # interleaved rounds of two back-to-back timings of each after the warm-up


@dataclass
class AttentionBackward:
    """The backward attention runs, and why (written to <run.dir>/arithmetic.json)."""

    kind: str  # "flash" or "recompute"
    how: str  # "given", "device" (a GPU), "eager", "too large", "measured", "cached" or "busy"
    ms: dict[str, float] = field(default_factory=dict)  # forward + backward of one layer's attention
    key: str = ""  # what the measurement holds for: CPU, threads, torch, shape, dtype

    def describe(self) -> str:
        why = {
            "given": "as configured",
            "device": "the device's own kernels",
            "eager": "not compiled: the recomputation only pays fused",
            "too large": "the score matrix would exceed its memory bound",
        }.get(self.how)
        if why is None:
            times = ", ".join(f"{name} {ms:.2f}" for name, ms in self.ms.items())
            why = f"auto, {self.how} at this run's attention shape; ms per layer forward + backward: {times}"
        return f"{self.kind} ({why})"


def resolve(cfg, args: ModelArgs, layout: Layout, device: torch.device):
    """(the config with attention_backward resolved, the AttentionBackward). Every rank takes rank 0's."""
    t = cfg.training
    if t.attention_backward == "recompute" and attention_shape(t, args, layout) is None:
        rows = f"{t.micro_batch_size} x 2 (DPO's pairs)" if rows_per_sample(t) == 2 else f"{t.micro_batch_size}"
        raise ConfigError(
            f"training.attention_backward = 'recompute' would hold {rows} x heads x {t.seq_len}^2 "
            f"attention scores a layer, over its bound of {MAX_SCORES:,}: set it to auto or flash, or lower "
            "training.micro_batch_size"
        )
    if t.attention_backward != "auto":
        choice = AttentionBackward(t.attention_backward, "given")
    elif device.type != "cpu":
        choice = AttentionBackward("flash", "device")
    elif not t.compile:
        choice = AttentionBackward("flash", "eager")
    elif (shape := attention_shape(t, args, layout)) is None:
        choice = AttentionBackward("flash", "too large")
    else:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        choice = agreed(cpu_choice(shape, attention_dtype(t)) if rank0 else None)
    return dataclasses.replace(cfg, training=dataclasses.replace(t, attention_backward=choice.kind)), choice


def attention_shape(t, args: ModelArgs, layout: Layout) -> tuple[int, int, int, int, int] | None:
    """(micro-batch rows, local heads, local kv heads, seq, head_dim) of a rank's attention, or None
    where the recomputed backward's scores would exceed MAX_SCORES (as applies() finds at run time)."""
    shards = layout.tp * layout.cp  # tensor parallel splits the heads; Ulysses trades the sequence for them
    heads, kv_heads = args.n_heads // shards, max(1, args.n_kv_heads // shards)
    rows = t.micro_batch_size * rows_per_sample(t)
    if rows * heads * t.seq_len**2 > MAX_SCORES:
        return None
    return (rows, heads, kv_heads, t.seq_len, args.head_size)


def rows_per_sample(t) -> int:
    """Sequences a sample of the batch is in the step's forward: a DPO preference pair is two
    (ParallelModel.rows_per_sample, known here before the model is built)."""
    return 2 if t.objective == "dpo" else 1


def attention_dtype(t) -> torch.dtype:
    """What attention computes in, for a training config whose arithmetic is resolved."""
    if t.dtype == "fp32" or fp32_classes(t)[1]:
        return torch.float32
    return torch.float16 if t.dtype == "fp16" else torch.bfloat16


def cpu_choice(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> AttentionBackward:
    batch, heads, kv_heads, seq, head_dim = shape
    key = (
        f"{cpu_model()}|{os.cpu_count()} cpus|{torch.get_num_threads()} threads|torch {torch.__version__}|"
        f"attention {batch}x{seq} heads {heads}/{kv_heads} of {head_dim}|{dtype}"
    )
    fresh = []

    def measure() -> dict:
        fresh.append(True)
        work = compiled(shape, dtype)  # outside the load's window: inductor compiles in worker processes
        with OtherLoad() as load:
            ms = probe(work)
        return {"ms": ms, "busy": load.share}

    def valid(record) -> bool:
        return quiet_record(record, "ms", ("flash", "recompute"))

    record = cached_measurement(key, measure, False, "arithmetic.json", valid)
    ms = record["ms"]
    kind = "recompute" if ms["recompute"] * (1 + MARGIN) < ms["flash"] else "flash"
    how = "busy" if record["busy"] > BUSY else "measured" if fresh else "cached"
    return AttentionBackward(kind, how, ms, key)


def compiled(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> dict:
    """Forward + backward of causal GQA attention at `shape` (batch, heads, kv_heads, seq, head_dim),
    compiled and called twice, with the flash kernel's backward ("flash") and the recomputed one."""
    batch, heads, kv_heads, seq, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=gen, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    kernels = {
        "flash": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "recompute": recomputed_attention,
    }
    work = {}
    for name, attend in kernels.items():
        compiled = torch.compile(own_code(attend), dynamic=False)

        def forward_backward(compiled=compiled):
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = compiled(*inputs)
            out.backward(torch.ones_like(out))

        work[name] = forward_backward
    for fn in work.values():  # compilation; the allocator's and oneDNN's first calls
        fn()
        fn()
    return work


def probe(work: dict) -> dict[str, float]:
    """Each piece of work's ms: interleaved rounds, the second-fastest timing of each."""
    samples = {name: [] for name in work}
    names = list(work)
    for r in range(ROUNDS):  # each round starts at the other; twice: the first pays for what the other left
        for name in names[r % 2 :] + names[: r % 2]:
            samples[name] += [timed_ms(work[name]), timed_ms(work[name])]
    return {name: round(sorted(ts)[1], 3) for name, ts in samples.items()}  # the second-fastest: arithmetic.py
