"""What the planner plans beside a layout (meshtrain.layout, the trainer's own): the workload, the
model, tokens per sequence, the kernels that run it (FP8 included), and what trains (every weight, or LoRA/QLoRA
adapters on a frozen base) on which objective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtrain.job.refusals import layout_refusal
from meshtrain.layout import Layout
from meshtrain.model.args import LoraSpec
from meshtrain.model.shapes import Shape

if TYPE_CHECKING:
    from meshtrain.job import Job


@dataclass(frozen=True)
class Workload:
    """What is trained, and how: the model, tokens per sequence, precision (bf16 storage with fp32
    GEMMs: `fp32_arithmetic`, with fp32 attention: `fp32_attention`; training.bf16_compute), the
    device type whose kernels run the step (CUDA fuses RMSNorm into one kernel that saves less than
    the CPU's composite one) and whether the blocks and the loss are compiled (training.compile:
    inductor keeps fewer, fused tensors for backward). `peft`: [peft] resolved
    (the job's `lora`; None: every weight trains); `objective`: training.objective
    ("dpo": each batch element is a pair of sequences, and a no-grad reference forward runs per
    micro-batch). `fp8`: training.fp8, the blocks' linears computed in FP8 (torchao). `cuda_graphs`:
    training.cuda_graphs, which removes host launch time the estimate does not count, but holds the
    job to one GPU. The batch, its split and CPU offload are the layout's."""

    shape: Shape
    seq_len: int
    dtype: str = "bf16"
    fp32_arithmetic: bool = False
    attention: str = "flash"  # "math" materialises the s x s scores (GPT arch without flash attention)
    device: str = "cuda"  # "cuda" or "cpu"
    compiled: bool = False
    fp32_attention: bool = False
    peft: LoraSpec | None = None
    objective: str = "lm"
    fp8: str = "off"  # "tensorwise" or "rowwise"
    cuda_graphs: bool = False

    @property
    def sequences(self) -> int:
        """Sequences per batch element: a DPO pair is two (chosen, rejected)."""
        return 2 if self.objective == "dpo" else 1

    @property
    def quantized(self) -> bool:
        return self.peft is not None and self.peft.quantized


def workload_of(job: Job) -> Workload:
    """A resolved job's workload (its arithmetic resolved on its device, `Job.on_device`, where it was),
    with its adapters and objective: what the trainer's memory warning and run.plan_check estimate."""
    from meshtrain.parallel.precision import fp32_classes

    t = job.cfg.training
    fp32_gemm, fp32_attention = fp32_classes(t)
    return Workload(
        job.shape,
        t.seq_len,
        t.dtype,
        fp32_gemm,
        device="cuda" if job.device is not None and job.device.type == "cuda" else "cpu",
        compiled=t.compile,
        fp32_attention=fp32_attention,
        peft=job.lora,
        objective=t.objective,
        fp8=t.fp8,
        cuda_graphs=t.cuda_graphs,
    )


def workload_refusal(w: Workload, layout: Layout) -> str:
    """Why meshtrain cannot train this workload on this layout ("" if it can), in its trainer's words."""
    return layout_refusal(w.shape, layout, w.peft, w.objective, w.fp8, w.cuda_graphs)
