"""Tensor parallelism (Megatron-LM) with sequence parallelism, on DTensor's `parallelize_module`.

Attention heads and the MLP hidden dimension are split across the tp group: wq/wk/wv/w1/w3 by
columns, wo/w2 by rows, so each block needs one all-reduce in forward and one in backward (or, with
sequence parallelism, a reduce-scatter + all-gather pair, and norms/residuals split along the sequence).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtrain.model.shapes import BLOCK_SHARDED_DIM, COLUMN


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
        block_plan: dict[str, object] = {
            # cos/sin (the None entries) stay plain tensors
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            **{
                name: ColwiseParallel() if dim == COLUMN else RowwiseParallel(output_layouts=seq)
                for name, dim in BLOCK_SHARDED_DIM.items()
            },
        }
        if sequence_parallel:
            block_plan["attention_norm"] = SequenceParallel()
            block_plan["ffn_norm"] = SequenceParallel()
        if _unwrap(block).attention.q_norm is not None:
            # Qwen3's per-head norms see this rank's heads (dim 2 of (batch, seq, heads, head_dim)):
            # their weights are replicated and their gradients summed over the heads of every rank.
            for norm in ("attention.q_norm", "attention.k_norm"):
                block_plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(_unwrap(block), tp_mesh, block_plan)


def _unwrap(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)
