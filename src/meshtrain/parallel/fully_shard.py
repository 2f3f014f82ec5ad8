"""ZeRO-2/3 and hybrid sharding with FSDP2 (`fully_shard`): per-parameter DTensor shards on the dp mesh."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from meshtrain.model.moe import GroupedExperts


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    zero: int,
    param_dtype: torch.dtype | None,
    cpu_offload: bool = False,
    ignored: set[nn.Parameter] | None = None,
    experts: tuple[DeviceMesh, int] | None = None,
) -> None:
    """Shard each block, then the rest (embeddings, final norm, output) as the root group.

    zero 3 frees the gathered parameters after each block's forward and gathers them again in
    backward; zero 2 keeps them between forward and backward (less communication, more memory).
    A 2-D dp_mesh (dp_replicate, dp_shard) is HSDP: shard within a group, replicate across groups.
    bf16/fp16 training computes in bf16/fp16 and reduces gradients in fp32; the sharded master
    weights and the optimizer states stay fp32. `cpu_offload` (ZeRO-3 on a GPU): the shards, their
    gradients and the optimizer states live in pinned host memory and the optimizer steps there;
    each all-gather first copies the local shard to the device. `ignored`: parameters FSDP leaves
    alone (expert parallelism's experts where no other rank holds the same ones: their gradients are
    reduced by EP). `experts` (mesh, divisor): expert parallelism's experts are sharded over the mesh of
    the ranks holding the same experts (torchtitan's efsdp), on dim 1 (dim 0 is EP's split), each in a
    group of its own inside its block's; their reduce-scatter sums over those ranks and divides by the
    ranks every loss is a share of (dp x cp), since the all-to-all already summed the other ep ranks'.
    """
    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype
        else MixedPrecisionPolicy()
    )
    # A block's inputs are left as they come: its hidden states are already in the compute dtype
    # (the embedding's and the previous block's output), and the rotary table stays fp32, as under
    # autocast, instead of a bf16 copy of the whole table made for every block.
    block_mp = dataclasses.replace(mp, cast_forward_inputs=False)
    offload = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's backward comes right after its forward: resharding it would only mean
        # gathering the same parameters again (torchtitan does the same).
        reshard = zero == 3 and i < len(blocks) - 1
        if experts is not None:
            shard_experts(block, *experts, reshard, block_mp)
        fully_shard(
            block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=block_mp, ignored_params=ignored, **offload
        )
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp, ignored_params=ignored, **offload)


def shard_experts(block: nn.Module, mesh: DeviceMesh, divisor: int, reshard: bool, mp: MixedPrecisionPolicy) -> None:
    for module in block.modules():
        if isinstance(module, GroupedExperts):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, shard_placement_fn=_on_dim_1)
            module.set_gradient_divide_factor(divisor)
            if mesh.device_type == "cpu":  # gloo has no pre-multiplied sum: sum, then divide
                module.set_force_sum_reduction_for_comms(True)


def _on_dim_1(param: nn.Parameter) -> Shard:
    return Shard(1)
