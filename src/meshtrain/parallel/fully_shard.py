"""ZeRO-2/3 and hybrid sharding with FSDP2 (`fully_shard`): per-parameter DTensor shards on the dp mesh."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    zero: int,
    param_dtype: torch.dtype | None,
    cpu_offload: bool = False,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard each block, then the rest (embeddings, final norm, output) as the root group.

    zero 3 frees the gathered parameters after each block's forward and gathers them again in
    backward; zero 2 keeps them between forward and backward (less communication, more memory).
    A 2-D dp_mesh (dp_replicate, dp_shard) is HSDP: shard within a group, replicate across groups.
    bf16/fp16 training computes in bf16/fp16 and reduces gradients in fp32; the sharded master
    weights and the optimizer states stay fp32. `cpu_offload` (ZeRO-3 on a GPU): the shards, their
    gradients and the optimizer states live in pinned host memory and the optimizer steps there;
    each all-gather first copies the local shard to the device. `ignored`: parameters FSDP leaves
    alone (expert parallelism's experts, split over other ranks, their gradients reduced by EP).
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
        fully_shard(
            block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=block_mp, ignored_params=ignored, **offload
        )
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp, ignored_params=ignored, **offload)
