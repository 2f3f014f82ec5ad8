"""The layout of a job: its parallel degrees and every rule derived from them, defined once.

The trainer reads it (parallel/mesh.py builds the DeviceMesh of a layout, parallel/pipeline.py cuts
the stages it names) and so does the planner (plan/ predicts the memory and speed of layouts it
enumerates): data-parallel degree and shard degree, stages per rank and the layers of each stage,
which rank holds the embedding and the output, a rank's mesh coordinates, the ZeRO-1 optimizer
partition, and the checks that refuse a layout, with the words the user reads.

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
from meshtrain.errors import ConfigError

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
    and recompute activations, each field named as its config key (`Layout.from_config` reads them,
    `apply_to` writes them back), resolved for one world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (all-to-all attention)
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
        if self.cpu_offload:
            text += " + CPU offload"
        if self.pp > 1:
            text += f", {self.pp_schedule}" + (f" v{self.pp_virtual_stages}" if self.stages_per_rank > 1 else "")
        return f"{text}, micro-batch {self.micro_batch_size}, AC {self.activation_checkpointing}"

    @classmethod
    def from_config(cls, cfg: Config, world: int) -> "Layout":
        """The layout of a config on `world` ranks, with the reasons when its degrees do not fit."""
        p = cfg.parallel  # single values are checked by config.validate
        model_ranks = p.tp * p.pp * p.cp
        if world % model_ranks:
            raise ConfigError(
                f"world size {world} is not divisible by parallel.tp ({p.tp}) x parallel.pp ({p.pp}) x parallel.cp "
                f"({p.cp}) = {model_ranks}: the data-parallel degree is world / (tp x pp x cp), so use a world size "
                f"that is a multiple of {model_ranks} or change tp/pp/cp"
            )
        dp = world // model_ranks
        if dp % p.dp_replicate:
            raise ConfigError(
                f"the data-parallel degree world / (tp x pp x cp) = {dp} is not divisible by parallel.dp_replicate "
                f"({p.dp_replicate})"
            )
        if p.dp_shard and p.dp_shard != dp // p.dp_replicate:
            raise ConfigError(
                f"parallel.dp_shard = {p.dp_shard} does not fit {world} ranks: world / (tp x pp x cp x dp_replicate)"
                f" = {dp // p.dp_replicate}; leave it 0 to derive it"
            )
        if p.dp_replicate > 1 and p.zero < 2:
            raise ConfigError(
                f"parallel.dp_replicate = {p.dp_replicate} is hybrid sharding and needs parallel.zero = 2 or 3; "
                "with zero 0/1 every data-parallel rank is already a replica (set dp_replicate = 1)"
            )
        if p.dp_replicate > 1 and p.dp_replicate == dp:
            raise ConfigError(
                f"parallel.dp_replicate = {p.dp_replicate} leaves a shard degree of 1: use parallel.zero = 0 for "
                "pure replication, or a smaller dp_replicate"
            )
        if p.zero < 2 and p.tp > 1 and dp * p.cp > 1:
            raise ConfigError(
                f"parallel.zero = {p.zero} (DDP) cannot replicate tensor-parallel (DTensor) parameters: "
                "use parallel.zero = 2 or 3 with parallel.tp > 1 (zero 0/1 work with pp and plain data parallel)"
            )
        shards = dp // p.dp_replicate * p.cp
        if p.cpu_offload and (p.zero != 3 or shards == 1):
            raise ConfigError(
                f"parallel.cpu_offload moves ZeRO-3's parameter shards to host memory: it needs parallel.zero = 3 "
                f"over more than one data-parallel rank (here zero {p.zero}, {shards} shard(s)); "
                "drop cpu_offload, or shard over more ranks"
            )
        values = {name: getattr(getattr(cfg, section), name) for name, section in _KEYS.items()}
        return cls(**values | {"dp_shard": dp // p.dp_replicate})

    def apply_to(self, cfg: Config) -> Config:
        """`cfg` with this layout's keys; parallel.dp_shard 0, derived from the world size it runs on."""
        values: dict[str, dict] = {}
        for name, section in _KEYS.items():
            values.setdefault(section, {})[name] = 0 if name == "dp_shard" else getattr(self, name)
        return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in values.items()})

    def validate(self, args, cfg: Config) -> None:
        """The layout against the model's shape (`args`: ModelArgs), the batch and the schedule."""
        self._validate_model(args)
        t = cfg.training
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"training.micro_batch_size ({self.micro_batch_size}) x data-parallel degree ({self.dp}) = {per_step}"
            )
        self.validate_schedule(cfg.parallel.pp_microbatches)
        self._validate_context(args, t)

    def _validate_context(self, args, t) -> None:
        """Context parallelism against the sequence and the heads it splits (parallel/context_parallel.py)."""
        if self.cp == 1:
            return
        if t.seq_len % self.cp:
            raise ConfigError(
                f"training.seq_len ({t.seq_len}) must be divisible by parallel.cp ({self.cp}): each rank holds "
                "an equal slice of every sequence"
            )
        local = t.seq_len // self.cp
        if self.tp > 1 and self.sequence_parallel and local % self.tp:
            raise ConfigError(
                f"a context-parallel slice of {local} tokens (training.seq_len / parallel.cp) must be divisible "
                f"by parallel.tp ({self.tp}) for sequence parallelism; change seq_len or cp"
            )
        heads, kv_heads = args.n_heads // self.tp, args.n_kv_heads // self.tp
        if heads % self.cp or (kv_heads % self.cp and self.cp % kv_heads):
            raise ConfigError(
                f"parallel.cp = {self.cp} splits each rank's attention heads ({heads} query, {kv_heads} key/value "
                "heads per tensor-parallel rank) for its all-to-all: the query heads must be divisible by cp, and "
                "the key/value heads divisible by cp or cp by them; lower cp or tp"
            )
        if t.objective == "dpo":
            raise ConfigError(
                "training.objective = 'dpo' with parallel.cp > 1 is not supported (DPO scores whole sequences); "
                "set parallel.cp = 1"
            )

    def _validate_model(self, args) -> None:
        if args.n_heads % self.tp or args.n_kv_heads % self.tp:
            raise ConfigError(
                f"model.n_heads ({args.n_heads}) and model.n_kv_heads ({args.n_kv_heads}) must both be divisible "
                f"by parallel.tp ({self.tp})"
            )
        if args.ffn_dim % self.tp:
            raise ConfigError(f"model.ffn_dim ({args.ffn_dim}) must be divisible by parallel.tp ({self.tp})")
        if args.vocab_multiple % self.tp:
            raise ConfigError(
                f"model.vocab_multiple ({args.vocab_multiple}) must be a multiple of parallel.tp ({self.tp}) so "
                "the padded vocabulary splits evenly"
            )
        stages = self.pp * self.pp_virtual_stages
        if self.pp > 1 and args.n_layers < stages:
            raise ConfigError(
                f"model.n_layers ({args.n_layers}) must be at least parallel.pp x parallel.pp_virtual_stages = "
                f"{self.pp} x {self.pp_virtual_stages} = {stages} (one layer per pipeline stage)"
            )

    def validate_schedule(self, pp_microbatches: int) -> None:
        """The schedule against the micro-batches it splits each step into (local batch / micro batch)."""
        if self.pp == 1:
            return
        n_microbatches = self.micro_batches
        if pp_microbatches and pp_microbatches != n_microbatches:
            raise ConfigError(
                f"parallel.pp_microbatches ({pp_microbatches}) does not match the local batch / "
                f"training.micro_batch_size = {n_microbatches}; leave it 0 to derive it"
            )
        v, schedule = self.pp_virtual_stages, self.pp_schedule
        if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
            raise ConfigError(
                f"parallel.pp_schedule = {schedule!r} runs one stage per rank: set "
                "parallel.pp_virtual_stages = 1, or use interleaved_1f1b / zero_bubble / zbv"
            )
        if schedule == "interleaved_1f1b" and v < 2:
            raise ConfigError("parallel.pp_schedule = 'interleaved_1f1b' needs parallel.pp_virtual_stages >= 2")
        if schedule == "zbv" and v != 2:
            raise ConfigError(
                "parallel.pp_schedule = 'zbv' places exactly 2 stages per rank in a V: set "
                "parallel.pp_virtual_stages = 2"
            )
        if schedule == "1f1b" and n_microbatches < self.pp:
            raise ConfigError(
                f"parallel.pp_schedule = '1f1b' needs at least parallel.pp ({self.pp}) "
                f"micro-batches per step, got {n_microbatches}: raise training.global_batch_size "
                "or lower training.micro_batch_size"
            )
        if schedule not in SINGLE_STAGE_SCHEDULES and n_microbatches % self.pp:
            raise ConfigError(
                f"parallel.pp_schedule = {schedule!r} needs a number of micro-batches "
                f"divisible by parallel.pp ({self.pp}), got {n_microbatches}"
            )


_KEYS = {f.name: section_of(f.name) for f in dataclasses.fields(Layout)}  # field -> its config section
