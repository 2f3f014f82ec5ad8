"""FP8 training of the blocks' linears with torchao's float8 (training.fp8).

`convert_to_float8_training` swaps each nn.Linear of the transformer blocks for torchao's
Float8Linear: its three GEMMs (output, input gradient, weight gradient) take fp8 operands scaled
per tensor ("tensorwise") or per row ("rowwise") and accumulate in higher precision; the master
weights, the optimizer and everything outside the blocks' linears stay as they were (the embedding
and the output projection keep the training dtype, as torchtitan does). Applied first, before TP,
compile and FSDP, which all see Float8Linear as an nn.Linear.

Under ZeRO-3 with tensorwise scaling the weights are all-gathered in fp8 (half of bf16's bytes),
with their scales computed once per step for every weight at once after the optimizer step
(`precompute_scales`). gloo cannot all-gather float8 tensors; FSDP2 sends a group of mixed dtypes as
bytes, and each block's group also holds its norms, so it never asks gloo to.

A GPU needs FP8 units (compute capability 8.9: Ada, Hopper and later; job/device.py refuses others).
A CPU has a reference
`_scaled_mm` about 1000x slower than a bf16 matmul, so there torchao's emulation runs the same
casts and scales with a high-precision matmul: same numbers, for tests, not speed.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

GEMM_MULTIPLE = 16  # torch._scaled_mm wants both dimensions of each operand divisible by 16


def apply_fp8(model: nn.Module, recipe: str, emulate: bool, fp8_all_gather: bool) -> None:
    """Swap the blocks' linears (both dimensions divisible by 16) for torchao's Float8Linear, in
    place. `emulate`: high-precision matmuls with fp8 numbers (a CPU); `fp8_all_gather`: FSDP2
    gathers the weights in fp8 (tensorwise only; the caller passes it under ZeRO-2/3)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)  # its GPU kernels' libraries, absent on a CPU
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fp8_all_gather and recipe == "tensorwise",
    )

    def in_a_block(module: nn.Module, name: str) -> bool:
        return (
            name.startswith("layers.")
            and module.in_features % GEMM_MULTIPLE == 0
            and module.out_features % GEMM_MULTIPLE == 0
        )

    convert_to_float8_training(model, config=config, module_filter_fn=in_a_block)


def precompute_scales(parts: list[nn.Module], recipe: str, fsdp: bool) -> None:
    """After the optimizer step, under ZeRO-2/3 with tensorwise FP8: every fp8-gathered weight's
    scale in one reduction (one amax all-reduce for the whole model instead of one per weight)."""
    if recipe != "tensorwise" or not fsdp:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
