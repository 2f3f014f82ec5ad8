"""Activation checkpointing: keep only block inputs in forward, recompute the rest in backward, or
(mode "op") keep the outputs that are expensive to recompute and recompute only the cheap ops."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional

# What mode "op" keeps: the matmuls (FP8's scaled one and torchao's amax reductions, whose recompute
# would need the same FP8 casts again), the attention kernels of every backend, and the
# tensor-parallel collectives (recomputing one would repeat its communication in backward). Every
# other op in a block is memory-bound (norms, rotary, SwiGLU's pointwise ops, casts, residual adds)
# and recomputed. Every matmul is kept, not every other one as torchtitan does: on the `small` preset
# (fp32, 2 x 512 tokens) every other one kept 230 MiB instead of 288 (20% less) for rerunning about
# 3 of each block's 7 matmuls, 37% of its forward GEMM FLOPs (12% of the step's). Step times on the
# shared 2-core machine were too noisy to resolve that, so the FLOPs decide: "full" is there for memory.
SAVED_OPS = frozenset(
    op.default
    for op in (
        _aten.mm,
        _aten.addmm,
        _aten.bmm,
        _aten.linear,
        _aten._scaled_mm,
        _aten.max,
        _aten.amax,
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_cudnn_attention,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _c10d.reduce_scatter_tensor,
        _c10d.all_gather_into_tensor,
        _c10d.all_reduce,
        _c10d.all_to_all_single,
    )
) | {torch.ops.higher_order.flex_attention}  # document masking on CUDA (model/masks.py): a higher-order op


_observers: list[Callable[[torch.Tensor], None]] = []


@contextlib.contextmanager
def observing_op_saves(observe: Callable[[torch.Tensor], None]):
    """Calls `observe` on each tensor mode "op" keeps while inside: they live in the checkpoint's
    own cache, which saved-tensor hooks never see (train/measure.py's SavedActivations counts them)."""
    _observers.append(observe)
    try:
        yield
    finally:
        _observers.remove(observe)


def op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Mode "op"'s choice for one op of a checkpointed block's forward (see SAVED_OPS)."""
    if op not in SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
    for observe in _observers:
        for t in outputs:
            if isinstance(t, torch.Tensor):
                observe(t)
    return CheckpointPolicy.MUST_SAVE


def _op_contexts():
    return create_selective_checkpoint_contexts(op_policy)


def unwrapped(block: nn.Module) -> nn.Module:
    """The block itself, inside apply_ac's checkpoint wrapper if it has one: what TP's and CP's
    plans address by name."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def apply_ac(model: nn.Module, mode: str, every: int = 1, random: bool = False) -> None:
    """mode "full": every block; "selective": every `every`-th block (memory for compute, in steps);
    "op": every block, saving what op_policy keeps. `random`: the blocks draw random numbers (LoRA's
    dropout), so the recomputation restores the RNG state to draw the same masks."""
    if mode == "none":
        return
    extra = {"context_fn": _op_contexts} if mode == "op" else {}
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode in ("full", "op") or i % every == 0:
            model.layers[name] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=random, **extra
            )
