"""What the planner plans beside a layout (meshtrain.layout, the trainer's own): the workload, the
model, tokens per sequence and the kernels that run it."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.model.shapes import Shape


@dataclass(frozen=True)
class Workload:
    """What is trained, and how: the model, tokens per sequence, precision (bf16 storage with fp32
    GEMMs: `fp32_arithmetic`, with fp32 attention: `fp32_attention`; training.bf16_compute), the
    device type whose kernels run the step (CUDA fuses RMSNorm into one kernel that saves less than
    the CPU's composite one) and whether the blocks and the loss are compiled (training.compile:
    inductor keeps fewer, fused tensors for backward). The batch and its split are the layout's."""

    shape: Shape
    seq_len: int
    dtype: str = "bf16"
    fp32_arithmetic: bool = False
    attention: str = "flash"  # "math" materialises the s x s scores (GPT arch without flash attention)
    device: str = "cuda"  # "cuda" or "cpu"
    compiled: bool = False
    fp32_attention: bool = False
