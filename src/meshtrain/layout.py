"""The layout of a job: its parallel degrees and every rule derived from them, defined once.

The trainer reads it (parallel/mesh.py builds the DeviceMesh of a layout, parallel/pipeline.py cuts
the stages it names) and so does the planner (plan/ predicts the memory and speed of layouts it
enumerates): data-parallel degree and shard degree, stages per rank and the layers of each stage,
which rank holds the embedding and the output, a rank's mesh coordinates, the ZeRO-1 optimizer
partition. The rules that refuse a layout, in the words the user reads, are job/layout.py's.

Expert parallelism borrows data-parallel ranks (torchtitan's rule): a second view of the same ranks,
pp, dp_replicate, expert_replicas, ep, tp, splits dp_shard x cp into its innermost ep ranks, which
share their MoE layers' experts, and the expert replicas across them.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallelism is innermost so
that its frequent collectives stay inside a node, context parallelism next to it (an all-to-all per
attention); pipeline outermost because it only sends activations between neighbours.
DP = WORLD / (TP x PP x CP) (Megatron's rule). Context-parallel ranks read the same sequences and
each computes a slice of every sequence, so for gradients and losses they are data-parallel ranks:
gradients average, and ZeRO shards, over DP x CP (torchtitan's dp_shard_cp), batches split over DP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtrain.config import SINGLE_STAGE_SCHEDULES, Config, section_of

AC_MODES = ("none", "selective", "op", "full")


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        bounds.append(list(range(start, start + size)))
        start += size
    return bounds


def zero1_partition(sizes: list[tuple[int, bool]], ranks: int) -> list[int]:
    """Elements of optimizer state each rank owns under ZeRO-1, as torch's ZeroRedundancyOptimizer
    assigns whole tensors (size, is_matrix): matrices, then vectors (two param groups); in each,
    largest first, every tensor to the rank holding the fewest elements so far."""
    owned = [0] * ranks
    for matrices in (True, False):
        for n in sorted((n for n, is_matrix in sizes if is_matrix == matrices), reverse=True):
            owned[owned.index(min(owned))] += n
    return owned


@dataclass(frozen=True)
class Layout:
    """Who holds and computes what: the [parallel] keys and the [training] keys that split the batch
    and recompute activations, each field named as its config key (job/layout.py's `layout_of` reads
    them, `apply_to` writes them back), resolved for one world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (all-to-all attention)
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep of the dp x cp ranks
    dp_replicate: int = 1
    dp_shard: int = 1  # resolved: parallel.dp_shard = 0 is world / (tp x pp x dp_replicate)
    zero: int = 0
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    cpu_offload: bool = False  # ZeRO-3's shards, gradients and optimizer states in host memory
    global_batch_size: int = 1
    micro_batch_size: int = 1
    activation_checkpointing: str = "none"
    ac_every: int = 2

    @property
    def dp(self) -> int:
        """The data-parallel degree: where batches split (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks whose gradients average (and over which the loss is a mean): DP x CP."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks one FSDP replica shards each parameter over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts under expert parallelism (their gradients summed): DP x CP / EP."""
        return self.dp_cp // self.ep

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on one rank: accumulation steps, or the pipeline schedule's."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def ddp(self) -> bool:
        """The model is wrapped in DDP: replicas (ZeRO-0/1) without pipelining."""
        return self.dp_cp > 1 and not self.fsdp and self.pp == 1

    @property
    def averages_after_backward(self) -> bool:
        """Pipeline stages replicated by plain data parallelism average their gradients after the
        schedule's backward (DDP's reducer cannot follow a schedule's several forwards)."""
        return self.dp_cp > 1 and not self.fsdp and self.pp > 1

    @property
    def fsdp(self) -> bool:
        """Parameters are FSDP2 shards (ZeRO-2/3 over more than one rank)."""
        return self.zero >= 2 and self.dp_cp > 1

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.pp == 1 or self.pp_schedule in SINGLE_STAGE_SCHEDULES else self.pp_virtual_stages

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The pipeline stages a pipeline rank holds: loop-style (r, r + pp, ...), or V-style for
        zbv (r and 2 pp - 1 - r)."""
        if self.pp_schedule == "zbv" and self.pp > 1:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + v * self.pp for v in range(self.stages_per_rank)]

    def stage_layers(self, n_layers: int, pp_rank: int) -> list[list[int]]:
        """The blocks of each pipeline stage this pipeline rank holds."""
        if self.pp == 1:
            return [list(range(n_layers))]
        layers = split_layers(n_layers, self.n_stages)
        return [layers[s] for s in self.stage_ids(pp_rank)]

    def holds_first_stage(self, pp_rank: int) -> bool:
        return self.pp == 1 or 0 in self.stage_ids(pp_rank)

    def holds_last_stage(self, pp_rank: int) -> bool:
        return self.pp == 1 or self.n_stages - 1 in self.stage_ids(pp_rank)

    def named_dims(self) -> list[tuple[str, int]]:
        """The mesh's dimensions of more than one rank, outermost first."""
        dims = (
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        )
        return [(n, d) for n, d in dims if d > 1]

    def coordinates(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of a global rank: which pipeline rank, shard, sequence slice and
        tensor-parallel slice it holds. "shard": its place among the dp_shard x cp ranks FSDP shards over."""
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        dp_shard = dp_rank % self.dp_shard
        return {
            "pp": pp_rank,
            "dp": dp_rank,
            "dp_shard": dp_shard,
            "cp": cp_rank,
            "tp": tp_rank,
            "shard": dp_shard * self.cp + cp_rank,
        }

    def describe(self) -> str:
        dims = (("TP", self.tp), ("CP", self.cp), ("PP", self.pp), ("DP", self.dp))
        parts = [f"{name} {size}" for name, size in dims if size > 1]
        text = " x ".join(parts) or "1 GPU"
        if self.dp_cp > 1:
            text += f", ZeRO-{self.zero}" + (f" (replicate {self.dp_replicate})" if self.dp_replicate > 1 else "")
        if self.ep > 1:
            text += f", EP {self.ep}"
        if self.cpu_offload:
            text += " + CPU offload"
        if self.pp > 1:
            text += f", {self.pp_schedule}" + (f" v{self.pp_virtual_stages}" if self.stages_per_rank > 1 else "")
        return f"{text}, micro-batch {self.micro_batch_size}, AC {self.activation_checkpointing}"

    def apply_to(self, cfg: Config) -> Config:
        """`cfg` with this layout's keys; parallel.dp_shard 0, derived from the world size it runs on."""
        values: dict[str, dict] = {}
        for name, section in CONFIG_SECTIONS.items():
            values.setdefault(section, {})[name] = 0 if name == "dp_shard" else getattr(self, name)
        return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in values.items()})


CONFIG_SECTIONS = {f.name: section_of(f.name) for f in dataclasses.fields(Layout)}  # field -> its config section
