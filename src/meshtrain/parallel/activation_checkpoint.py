"""Activation checkpointing: keep only block inputs in forward, recompute the rest in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def apply_ac(model: nn.Module, mode: str, every: int = 1) -> None:
    """mode "full": every block; "selective": every `every`-th block (memory for compute, in steps)."""
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or i % every == 0:
            model.layers[name] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False
            )
