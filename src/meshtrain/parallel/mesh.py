"""The layout: parallel degrees, their validation, and the DeviceMesh they define.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallelism is innermost so
that its frequent collectives stay inside a node; pipeline outermost because it only sends
activations between neighbours. DP = WORLD / (TP x PP) (Megatron's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def named_dims(self) -> list[tuple[str, int]]:
        return [(n, d) for n, d in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                    ("dp_shard", self.dp_shard), ("tp", self.tp)) if d > 1]

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

    @property
    def dp_rank(self) -> int:
        dp = self.mesh("dp")
        return 0 if dp is None else dp.get_local_rank()
