"""The layout: parallel degrees, their validation, and the DeviceMesh they define.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallelism is innermost so
that its frequent collectives stay inside a node; pipeline outermost because it only sends
activations between neighbours. DP = WORLD / (TP x PP) (Megatron's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtrain.config import SINGLE_STAGE_SCHEDULES, Config, micro_batches
from meshtrain.errors import ConfigError


@dataclass
class ParallelDims:
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    zero: int = 0

    @classmethod
    def from_config(cls, parallel, world_size: int) -> "ParallelDims":
        """Derive DP = world / (tp x pp) and the shard degree, with the reasons when they don't fit."""
        p = parallel  # single values are checked by config.validate
        if world_size % (p.tp * p.pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp ({p.tp}) x parallel.pp ({p.pp}) = "
                f"{p.tp * p.pp}: the data-parallel degree is world / (tp x pp), so use a world size that is a "
                f"multiple of {p.tp * p.pp} or change tp/pp"
            )
        dp = world_size // (p.tp * p.pp)
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
            world_size=world_size,
            pp=p.pp,
            dp_replicate=p.dp_replicate,
            dp_shard=dp // p.dp_replicate,
            tp=p.tp,
            zero=p.zero,
        )

    def validate(self, args, cfg: Config) -> None:
        """The layout against the model's shape, the batch and the pipeline schedule."""
        self._validate_model(args, cfg.parallel)
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
        self._validate_schedule(cfg.parallel, micro_batches(t, self.dp))

    def _validate_model(self, args, p) -> None:
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
        stages = self.pp * p.pp_virtual_stages
        if self.pp > 1 and args.n_layers < stages:
            raise ConfigError(
                f"model.n_layers ({args.n_layers}) must be at least parallel.pp x parallel.pp_virtual_stages = "
                f"{self.pp} x {p.pp_virtual_stages} = {stages} (one layer per pipeline stage)"
            )
        if self.pp > 1 and args.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings cannot be used with parallel.pp > 1: the embedding and the "
                "output live on different pipeline stages"
            )

    def _validate_schedule(self, p, n_microbatches: int) -> None:
        """n_microbatches = local batch / micro batch: what the schedule splits each step into."""
        if self.pp == 1:
            return
        if p.pp_microbatches and p.pp_microbatches != n_microbatches:
            raise ConfigError(
                f"parallel.pp_microbatches ({p.pp_microbatches}) does not match the local batch / "
                f"training.micro_batch_size = {n_microbatches}; leave it 0 to derive it"
            )
        v = p.pp_virtual_stages
        if p.pp_schedule in SINGLE_STAGE_SCHEDULES and v != 1:
            raise ConfigError(
                f"parallel.pp_schedule = {p.pp_schedule!r} runs one stage per rank: set "
                "parallel.pp_virtual_stages = 1, or use interleaved_1f1b / zero_bubble / zbv"
            )
        if p.pp_schedule == "interleaved_1f1b" and v < 2:
            raise ConfigError("parallel.pp_schedule = 'interleaved_1f1b' needs parallel.pp_virtual_stages >= 2")
        if p.pp_schedule == "zbv" and v != 2:
            raise ConfigError(
                "parallel.pp_schedule = 'zbv' places exactly 2 stages per rank in a V: set "
                "parallel.pp_virtual_stages = 2"
            )
        if p.pp_schedule == "1f1b" and n_microbatches < self.pp:
            raise ConfigError(
                f"parallel.pp_schedule = '1f1b' needs at least parallel.pp ({self.pp}) "
                f"micro-batches per step, got {n_microbatches}: raise training.global_batch_size "
                "or lower training.micro_batch_size"
            )
        if p.pp_schedule not in SINGLE_STAGE_SCHEDULES and n_microbatches % self.pp:
            raise ConfigError(
                f"parallel.pp_schedule = {p.pp_schedule!r} needs a number of micro-batches "
                f"divisible by parallel.pp ({self.pp}), got {n_microbatches}"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """ "DDP 2", "FSDP 2 x TP 2, ZeRO-3", "single process"."""
        names = {"dp_shard": "FSDP" if self.zero >= 2 else "DDP", "dp_replicate": "replicate", "tp": "TP", "pp": "PP"}
        layout = " x ".join(f"{names[n]} {size}" for n, size in self.named_dims()) or "single process"
        return f"{layout}, ZeRO-{self.zero}" if self.dp > 1 else layout

    def named_dims(self) -> list[tuple[str, int]]:
        return [
            (n, d)
            for n, d in (
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("tp", self.tp),
            )
            if d > 1
        ]

    def build_mesh(self, device_type: str) -> None:
        """Build the world mesh (none for one process). Sub-meshes are looked up with `mesh(name)`;
        "dp" is dp_replicate x dp_shard flattened (possibly of size 1): where batches are split
        and losses averaged."""
        self._meshes: dict[str, DeviceMesh] = {}
        if self.world_size == 1 and not dist.is_initialized():
            return
        dims = self.named_dims() or [("dp_shard", 1)]
        names = tuple(n for n, _ in dims)
        world = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        self._meshes = {"world": world, **{n: world[n] for n in names}}
        dp_names = tuple(n for n in names if n.startswith("dp_"))
        if dp_names:
            self._meshes["dp"] = world[dp_names]._flatten("dp") if len(dp_names) > 1 else world[dp_names[0]]

    def mesh(self, name: str) -> DeviceMesh | None:
        """A (sub-)mesh by name: world, pp, dp_replicate, dp_shard, tp, dp; None if not in the layout."""
        return self._meshes.get(name)

    @property
    def dp_group(self):
        """The process group over which losses are averaged (None: a single DP rank)."""
        dp = self.mesh("dp")
        return None if dp is None else dp.get_group()

    def fsdp_mesh(self) -> DeviceMesh:
        """1-D (dp_shard) for ZeRO-2/3, 2-D (dp_replicate, dp_shard) for hybrid sharding."""
        world = self.mesh("world")
        return world["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else world["dp_shard"]

    def rank_in(self, name: str) -> int:
        mesh = self.mesh(name)
        return 0 if mesh is None else mesh.get_local_rank()

    def describe_groups(self) -> list[str]:
        """Lines such as "tp groups: [0, 1] [2, 3]": which global ranks form each group."""
        world = self.mesh("world")
        if world is None:
            return []
        names = list(world.mesh_dim_names)
        lines = []
        for i, name in enumerate(names):
            groups = world.mesh.movedim(i, -1).reshape(-1, world.mesh.shape[i]).tolist()
            lines.append(f"{name} groups: " + " ".join(str(g) for g in groups))
        if len([n for n in names if n.startswith("dp_")]) > 1:
            dp_axes = [i for i, n in enumerate(names) if n.startswith("dp_")]
            rest = [i for i in range(len(names)) if i not in dp_axes]
            groups = world.mesh.permute(*rest, *dp_axes).reshape(-1, self.dp).tolist()
            lines.append("dp groups (replicate x shard): " + " ".join(str(g) for g in groups))
        return lines

    @property
    def dp_rank(self) -> int:
        dp = self.mesh("dp")
        return 0 if dp is None else dp.get_local_rank()
