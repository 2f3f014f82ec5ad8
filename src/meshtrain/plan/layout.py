"""A layout to plan: the parallel degrees and the per-rank batch settings, the same knobs as the
[parallel] and [training] config sections, and what the job trains (model, sequence, batch, dtype)."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import SINGLE_STAGE_SCHEDULES, Config
from meshtrain.parallel.pipeline import split_layers, stage_ids
from meshtrain.plan.shapes import Shape

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_replicate: int = 1
    zero: int = 0
    micro_batch: int = 1
    ac: str = "none"
    ac_every: int = 2
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def fsdp(self) -> bool:
        """Parameters are FSDP2 shards (ZeRO-2/3 over more than one rank)."""
        return self.zero >= 2 and self.dp > 1

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.pp == 1 or self.pp_schedule in SINGLE_STAGE_SCHEDULES else self.virtual_stages

    def stage_layers(self, n_layers: int, pp_rank: int) -> list[list[int]]:
        """The blocks of each pipeline stage this pipeline rank holds."""
        if self.pp == 1:
            return [list(range(n_layers))]
        layers = split_layers(n_layers, self.pp * self.stages_per_rank)
        return [layers[s] for s in stage_ids(pp_rank, self.pp, self.stages_per_rank, self.pp_schedule)]

    def holds_first_stage(self, pp_rank: int) -> bool:
        return self.pp == 1 or 0 in stage_ids(pp_rank, self.pp, self.stages_per_rank, self.pp_schedule)

    def holds_last_stage(self, pp_rank: int) -> bool:
        n = self.pp * self.stages_per_rank
        return self.pp == 1 or n - 1 in stage_ids(pp_rank, self.pp, self.stages_per_rank, self.pp_schedule)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of a global rank (mesh order pp, dp_replicate, dp_shard, tp; see
        parallel.mesh): which pipeline rank, shard and tensor-parallel slice it holds."""
        tp_rank, rest = rank % self.tp, rank // self.tp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        return {"pp": pp_rank, "dp": dp_rank, "dp_shard": dp_rank % self.dp_shard, "tp": tp_rank}

    def describe(self) -> str:
        parts = [f"{name} {size}" for name, size in (("TP", self.tp), ("PP", self.pp), ("DP", self.dp)) if size > 1]
        text = " x ".join(parts) or "1 GPU"
        if self.dp > 1:
            text += f", ZeRO-{self.zero}" + (f" (replicate {self.dp_replicate})" if self.dp_replicate > 1 else "")
        if self.pp > 1:
            text += f", {self.pp_schedule}" + (f" v{self.virtual_stages}" if self.stages_per_rank > 1 else "")
        return f"{text}, micro-batch {self.micro_batch}, AC {self.ac}"

    @classmethod
    def from_config(cls, cfg: Config, world: int) -> "Layout":
        p, t = cfg.parallel, cfg.training
        return cls(
            tp=p.tp,
            pp=p.pp,
            dp=world // (p.tp * p.pp),
            dp_replicate=p.dp_replicate,
            zero=p.zero,
            micro_batch=t.micro_batch_size,
            ac=t.activation_checkpointing,
            ac_every=t.ac_every,
            pp_schedule=p.pp_schedule,
            virtual_stages=p.pp_virtual_stages,
            sequence_parallel=p.sequence_parallel,
            loss_parallel=p.loss_parallel,
        )


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
