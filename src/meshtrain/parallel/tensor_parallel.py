"""Tensor parallelism (Megatron-LM) with sequence parallelism, on DTensor's `parallelize_module`.

Attention heads and the MLP hidden dimension are split across the tp group: wq/wk/wv/w1/w3 by
columns, wo/w2 by rows, so each block needs one all-reduce in forward and one in backward (or, with
sequence parallelism, a reduce-scatter + all-gather pair, and norms/residuals split along the sequence).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtrain.model.lora import LoRALinear
from meshtrain.model.shapes import BLOCK_SHARDED_DIM, COLUMN
from meshtrain.parallel.activation_checkpoint import unwrapped


class _SplitsAdapters:
    """A LoRA linear's adapters split with its weight: a column-parallel W (its rows split) splits B's
    rows and replicates A; a row-parallel W (its columns split) splits A's columns and replicates B.
    So B A is split exactly as W is, and each rank computes its share of the update with no extra
    collective (the row-parallel A x is a partial sum, reduced with W x by the same all-reduce)."""

    placements: dict[str, object]

    def _partition_linear_fn(self, name, module, device_mesh):
        for param_name, param in list(module.named_parameters(recurse=False)):
            placement = self.placements[param_name]
            shard = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(shard, requires_grad=param.requires_grad))


class ColwiseLoRAParallel(_SplitsAdapters, ColwiseParallel):
    placements = {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)}


class RowwiseLoRAParallel(_SplitsAdapters, RowwiseParallel):
    placements = {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1), "lora_b": Replicate()}


def _linear_style(module: nn.Module, column: bool, seq) -> object:
    lora = isinstance(module, LoRALinear)
    if column:
        return ColwiseLoRAParallel() if lora else ColwiseParallel()
    return RowwiseLoRAParallel(output_layouts=seq) if lora else RowwiseParallel(output_layouts=seq)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Parallelise a Llama (or a pipeline stage of one) in place. With loss_parallel the logits stay
    sharded over the vocabulary and the loss must run under `torch.distributed.tensor.parallel.loss_parallel()`."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, plan)

    for block in model.layers.values():
        inner = unwrapped(block)
        block_plan: dict[str, object] = {
            # cos/sin (the None entries) stay plain tensors
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            **{
                name: _linear_style(inner.get_submodule(name), dim == COLUMN, seq)
                for name, dim in BLOCK_SHARDED_DIM.items()
            },
        }
        if sequence_parallel:
            block_plan["attention_norm"] = SequenceParallel()
            block_plan["ffn_norm"] = SequenceParallel()
        if inner.attention.q_norm is not None:
            # Qwen3's per-head norms see this rank's heads (dim 2 of (batch, seq, heads, head_dim)):
            # their weights are replicated and their gradients summed over the heads of every rank.
            for norm in ("attention.q_norm", "attention.k_norm"):
                block_plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(inner, tp_mesh, block_plan)
