"""The layout of a job: its parallel degrees and every rule derived from them, defined once.

The trainer reads it (parallel/mesh.py builds the DeviceMesh of a layout, parallel/pipeline.py cuts
the stages it names) and so does the planner (plan/ predicts the memory and speed of layouts it
enumerates): data-parallel degree and shard degree, stages per rank and the layers of each stage,
which rank holds the embedding and the output, a rank's mesh coordinates, the ZeRO-1 optimizer
partition, and the checks that refuse a layout, with the words the user reads.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallelism is innermost so
that its frequent collectives stay inside a node; pipeline outermost because it only sends
activations between neighbours. DP = WORLD / (TP x PP) (Megatron's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import SINGLE_STAGE_SCHEDULES, Config, micro_batches
from meshtrain.errors import ConfigError

AC_MODES = ("none", "selective", "full")


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
    """The parallel degrees and per-rank batch settings: the [parallel] and [training] knobs that
    decide who holds and computes what."""

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
        dims = (("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp))
        return [(n, d) for n, d in dims if d > 1]

    def coordinates(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of a global rank: which pipeline rank, shard and tensor-parallel
        slice it holds."""
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
        """The layout of a config on `world` ranks, with the reasons when its degrees do not fit."""
        p, t = cfg.parallel, cfg.training  # single values are checked by config.validate
        if world % (p.tp * p.pp):
            raise ConfigError(
                f"world size {world} is not divisible by parallel.tp ({p.tp}) x parallel.pp ({p.pp}) = "
                f"{p.tp * p.pp}: the data-parallel degree is world / (tp x pp), so use a world size that is a "
                f"multiple of {p.tp * p.pp} or change tp/pp"
            )
        dp = world // (p.tp * p.pp)
        if dp % p.dp_replicate:
            raise ConfigError(
                f"the data-parallel degree world / (tp x pp) = {dp} is not divisible by parallel.dp_replicate "
                f"({p.dp_replicate})"
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
        if p.zero < 2 and p.tp > 1 and dp > 1:
            raise ConfigError(
                f"parallel.zero = {p.zero} (DDP) cannot replicate tensor-parallel (DTensor) parameters: "
                "use parallel.zero = 2 or 3 with parallel.tp > 1 (zero 0/1 work with pp and plain data parallel)"
            )
        return cls(
            tp=p.tp,
            pp=p.pp,
            dp=dp,
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

    def validate(self, args, cfg: Config) -> None:
        """The layout against the model's shape (`args`: ModelArgs), the batch and the schedule."""
        self._validate_model(args)
        t = cfg.training
        if t.compile and self.tp > 1 and self.dp > 1:
            raise ConfigError(
                f"training.compile = true with parallel.tp = {self.tp} and FSDP over {self.dp} data-parallel ranks "
                "fails in torch 2.13 (FSDP hooks inside the whole-model graph that TP needs); compile TP alone or "
                "TP x PP, or run TP x FSDP eagerly"
            )
        per_step = t.micro_batch_size * self.dp
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"training.micro_batch_size ({t.micro_batch_size}) x data-parallel degree ({self.dp}) = {per_step}"
            )
        self._validate_schedule(cfg.parallel.pp_microbatches, micro_batches(t, self.dp))

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
        stages = self.pp * self.virtual_stages
        if self.pp > 1 and args.n_layers < stages:
            raise ConfigError(
                f"model.n_layers ({args.n_layers}) must be at least parallel.pp x parallel.pp_virtual_stages = "
                f"{self.pp} x {self.virtual_stages} = {stages} (one layer per pipeline stage)"
            )
        if self.pp > 1 and args.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings cannot be used with parallel.pp > 1: the embedding and the "
                "output live on different pipeline stages"
            )

    def _validate_schedule(self, pp_microbatches: int, n_microbatches: int) -> None:
        """n_microbatches = local batch / micro batch: what the schedule splits each step into."""
        if self.pp == 1:
            return
        if pp_microbatches and pp_microbatches != n_microbatches:
            raise ConfigError(
                f"parallel.pp_microbatches ({pp_microbatches}) does not match the local batch / "
                f"training.micro_batch_size = {n_microbatches}; leave it 0 to derive it"
            )
        v, schedule = self.virtual_stages, self.pp_schedule
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
