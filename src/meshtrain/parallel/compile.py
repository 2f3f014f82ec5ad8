"""torch.compile per transformer block (torchtitan's choice): blocks are identical, so one graph is
compiled and reused, and each block stays its own FSDP / activation-checkpointing unit.

With tensor parallelism the whole model is compiled instead: in torch 2.13 a compiled block hands
plain-tensor gradients back to the eager DTensor redistribution at its boundary (sequence-parallel
input), which fails in backward; with the redistributions inside one graph it works.

`emulate_precision_casts` keeps every bf16 rounding that eager mode does: without it inductor fuses
away a cast to bf16 and back, and bf16 training with fp32 arithmetic (parallel/precision.py) would
multiply unrounded values, giving other numbers than the eager step."""

from __future__ import annotations

from torch import nn

COMPILE_OPTIONS = {"emulate_precision_casts": True}


def apply_compile(model: nn.Module, tensor_parallel: bool = False) -> None:
    """Compile in place (`Module.compile`), which keeps parameter names unchanged."""
    if tensor_parallel:
        model.compile(options=COMPILE_OPTIONS)
        return
    for block in model.layers.values():
        block.compile(fullgraph=True, options=COMPILE_OPTIONS)
