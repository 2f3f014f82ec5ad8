"""torch.compile per transformer block (torchtitan's choice): blocks are identical, so one graph is
compiled and reused, and each block stays its own FSDP / activation-checkpointing unit."""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> None:
    """Compile every block in place (`Module.compile`), which keeps parameter names unchanged."""
    for block in model.layers.values():
        block.compile(fullgraph=True)
