"""The runtime side of a layout: the DeviceMesh its degrees define (meshtrain.layout holds the
degrees, their rules and their checks), its sub-meshes and process groups."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtrain.layout import Layout


class ParallelDims:
    """A layout (meshtrain.layout: the degrees and their rules) and, once built, its DeviceMesh."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._meshes: dict[str, DeviceMesh] = {}

    def describe(self) -> str:
        """ "DDP 2", "FSDP 2 x TP 2, ZeRO-3", "CP 2 x TP 2", "single process"; a ZeRO stage with one
        data-parallel rank is named as idle (a config kept across world sizes, as torchtitan's
        FSDP degree -1 is: nothing to shard here, so it says so rather than dropping it)."""
        zero = self.layout.zero
        names = {
            "dp_shard": "FSDP" if zero >= 2 else "DDP",
            "dp_replicate": "replicate",
            "cp": "CP",
            "tp": "TP",
            "pp": "PP",
        }
        text = " x ".join(f"{names[n]} {size}" for n, size in self.layout.named_dims()) or "single process"
        if self.layout.ep > 1:
            text += f" (EP {self.layout.ep})"
        if self.layout.dp_cp > 1:
            return f"{text}, ZeRO-{zero}"
        return f"{text} (ZeRO-{zero} idle: one data-parallel rank, nothing to shard)" if zero else text

    def build_mesh(self, device_type: str) -> None:
        """Build the world mesh (none for one process). Sub-meshes are looked up with `mesh(name)`:
        "dp" is dp_replicate x dp_shard flattened, where batches are split; "dp_cp" adds the
        context-parallel ranks: where gradients and losses average; "dp_shard_cp" is what FSDP shards
        over. A name whose ranks are all one rank is absent."""
        self._meshes = {}
        if self.layout.world == 1 and not dist.is_initialized():
            return
        dims = self.layout.named_dims() or [("dp_shard", 1)]
        names = tuple(n for n, _ in dims)
        world = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        self._meshes = {"world": world, **{n: world[n] for n in names}}
        for flat, parts in (
            ("dp", ("dp_replicate", "dp_shard")),
            ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
            ("dp_shard_cp", ("dp_shard", "cp")),
        ):
            present = tuple(n for n in parts if n in names)
            if len(present) == 1:
                self._meshes[flat] = world[present[0]]
            elif present:
                self._meshes[flat] = world[present]._flatten(flat)
        if self.layout.ep > 1:
            self._build_expert_mesh(device_type)

    def _build_expert_mesh(self, device_type: str) -> None:
        """The same ranks viewed as pp, dp_replicate, expert_replicas, ep, tp: "ep" is the innermost ep
        ranks of dp_shard x cp (the ranks numbered as in the world mesh), "expert_replicas" every rank
        holding the same experts (dp_replicate x the rest of dp_shard x cp)."""
        layout = self.layout
        dims = [
            ("pp", layout.pp),
            ("dp_replicate", layout.dp_replicate),
            ("expert_replicas", layout.dp_shard * layout.cp // layout.ep),
            ("ep", layout.ep),
            ("tp", layout.tp),
        ]
        dims = [(n, d) for n, d in dims if d > 1 or n == "ep"]
        names = tuple(n for n, _ in dims)
        experts = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        self._meshes |= {"expert_world": experts, "ep": experts["ep"]}
        replicas = tuple(n for n in ("dp_replicate", "expert_replicas") if n in names)
        if len(replicas) == 1:
            self._meshes["ep_replicas"] = experts[replicas[0]]
        elif replicas:
            self._meshes["ep_replicas"] = experts[replicas]._flatten("ep_replicas")

    def mesh(self, name: str) -> DeviceMesh | None:
        """A (sub-)mesh by name: world, pp, dp_replicate, dp_shard, cp, tp, dp, dp_cp, dp_shard_cp, and
        expert_world (the expert-parallel view of the ranks), ep, ep_replicas; None if not in the layout."""
        return self._meshes.get(name)

    @property
    def dp_group(self):
        """The process group over which gradients and losses are averaged, DP x CP (None: one rank)."""
        dp = self.mesh("dp_cp")
        return None if dp is None else dp.get_group()

    def fsdp_mesh(self) -> DeviceMesh:
        """1-D (dp_shard x cp) for ZeRO-2/3, 2-D (dp_replicate, dp_shard x cp) for hybrid sharding."""
        if self.layout.dp_replicate > 1:
            return self.mesh("world")["dp_replicate", "dp_shard_cp" if self.layout.cp > 1 else "dp_shard"]
        return self.mesh("dp_shard_cp")

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
        if (experts := self.mesh("expert_world")) is not None:
            axis = list(experts.mesh_dim_names).index("ep")
            groups = experts.mesh.movedim(axis, -1).reshape(-1, self.layout.ep).tolist()
            lines.append("ep groups: " + " ".join(str(g) for g in groups))
        if len([n for n in names if n.startswith("dp_")]) > 1:
            dp_axes = [i for i, n in enumerate(names) if n.startswith("dp_")]
            rest = [i for i in range(len(names)) if i not in dp_axes]
            groups = world.mesh.permute(*rest, *dp_axes).reshape(-1, self.layout.dp).tolist()
            lines.append("dp groups (replicate x shard): " + " ".join(str(g) for g in groups))
        return lines

    def pair_group(self, first_pp: int, last_pp: int):
        """The process group of the two pipeline ranks first_pp and last_pp that share this rank's
        other coordinates (tied embeddings). Every rank creates every pair's group, in one order, as
        `new_group` requires; returns this rank's."""
        world = self.mesh("world")
        axis = list(world.mesh_dim_names).index("pp")
        mine = None
        for ranks in world.mesh.movedim(axis, -1).reshape(-1, self.layout.pp).tolist():
            group = dist.new_group([ranks[first_pp], ranks[last_pp]])
            if dist.get_rank() in (ranks[first_pp], ranks[last_pp]):
                mine = group
        return mine

    @property
    def dp_rank(self) -> int:
        dp = self.mesh("dp")
        return 0 if dp is None else dp.get_local_rank()
