"""What the planner plans: a layout (meshtrain.layout, the trainer's own) and the workload it
trains (model, sequence, batch, precision, kernels), and the training config of the two."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import Config
from meshtrain.layout import AC_MODES, Layout
from meshtrain.plan.shapes import Shape

__all__ = ["AC_MODES", "Layout", "Workload", "to_config"]


@dataclass(frozen=True)
class Workload:
    """What is trained, and how: the model, tokens per sequence, sequences per optimizer step,
    precision (`fp32_arithmetic`: bf16 storage with fp32 matmuls, training.bf16_compute = "fp32"),
    the device type whose kernels run the step (CUDA fuses RMSNorm into one kernel that saves less
    than the CPU's composite one) and whether the blocks and the loss are compiled
    (training.compile: inductor keeps fewer, fused tensors for backward)."""

    shape: Shape
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    fp32_arithmetic: bool = False
    attention: str = "flash"  # "math" materialises the s x s scores (GPT arch without flash attention)
    device: str = "cuda"  # "cuda" or "cpu"
    compiled: bool = False

    def micro_batches(self, layout: Layout) -> int:
        return self.global_batch // (layout.micro_batch * layout.dp)


def to_config(layout: Layout, w: Workload, base: Config) -> Config:
    """`base` with this layout and workload in its [parallel] and [training] sections."""
    import dataclasses

    p = dataclasses.replace(
        base.parallel,
        tp=layout.tp,
        pp=layout.pp,
        dp_replicate=layout.dp_replicate,
        zero=layout.zero,
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.virtual_stages,
        sequence_parallel=layout.sequence_parallel,
        loss_parallel=layout.loss_parallel,
        pp_microbatches=0,
    )
    t = dataclasses.replace(
        base.training,
        micro_batch_size=layout.micro_batch,
        global_batch_size=w.global_batch,
        seq_len=w.seq_len,
        dtype="fp32" if w.dtype == "fp32" else "bf16",
        compile=w.compiled,
        activation_checkpointing=layout.ac,
        ac_every=layout.ac_every,
    )
    return dataclasses.replace(base, parallel=p, training=t)
