"""LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023): fine-tune a frozen model through low-rank
adapters beside its linears.

A target linear W (out x in) computes  y = W x + b + (alpha / r) B A dropout(x),  A (r x in), B (out x r).
B starts at zero, so the adapted model starts equal to the base; only A and B train, so the optimizer
holds 2 r (in + out) states per linear instead of 2 in out. QLoRA stores the frozen W in 4-bit NF4
(torchao's NF4Tensor: 0.52 bytes a parameter) and dequantizes it to bf16 in each forward.

The adapters live inside the linear (`wq.lora_a`, `wq.lora_b`), so the module tree, the parallel plans
and every base parameter's name stay as they are; tensor parallelism splits B with a column-parallel
linear's outputs and A with a row-parallel linear's inputs (parallel/tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.model.args import LoraSpec

ADAPTER_NAMES = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """nn.Linear plus its adapters; `adapters_on` False computes the base alone (DPO's reference)."""

    def __init__(self, base: nn.Linear, spec: LoraSpec):
        super().__init__(base.in_features, base.out_features, base.bias is not None, device=base.weight.device)
        self.weight, self.bias = base.weight, base.bias
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(spec.rank, base.in_features, device=device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, spec.rank, device=device))
        self.scale = spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        self.adapters_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight, self.bias)
        if not self.adapters_on:
            return y
        return y + self.linear(self.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Each of its three matmuls: the base's and the adapters' (parallel/precision.py's subclass
        runs them in fp32 arithmetic under training.bf16_compute)."""
        return F.linear(x, weight, bias)


def apply_lora(model: nn.Module, spec: LoraSpec, frozen_dtype: torch.dtype | None = None) -> None:
    """Put adapters on the target linears of every block in place and freeze everything else.
    `frozen_dtype`: the frozen weights' storage (bf16 under bf16 training: they never update, so
    they need no fp32 master copy). On the meta device, before any parallel plan."""
    for block in model.layers.values():
        for parent in (block.attention, block.feed_forward):
            for name in spec.targets:
                base = getattr(parent, name, None)
                if isinstance(base, nn.Linear) and not isinstance(base, LoRALinear):
                    setattr(parent, name, LoRALinear(base, spec))
    freeze_base(model, frozen_dtype)


def freeze_base(model: nn.Module, frozen_dtype: torch.dtype | None = None) -> None:
    """Only the adapters train (a model without adapters: nothing does, as DPO's reference);
    `frozen_dtype`: the storage of the frozen matrices. Again after tensor parallelism: its
    SequenceParallel re-registers the norms' weights as new (trainable) parameters."""
    for name, param in model.named_parameters():
        adapter = name.endswith(ADAPTER_NAMES)
        param.requires_grad_(adapter)
        if not adapter and frozen_dtype is not None and param.ndim >= 2:
            param.data = param.data.to(frozen_dtype)


def lora_modules(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def adapters_off(parts: list[nn.Module]):
    """The base model alone, for the duration (DPO's reference forward: no second copy in memory)."""
    modules = [m for part in parts for m in lora_modules(part)]
    for m in modules:
        m.adapters_on = False
    try:
        yield
    finally:
        for m in modules:
            m.adapters_on = True


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # QLoRA's: 64 weights share a scale, 256 scales a second-level one


def quantize_base(model: nn.Module) -> None:
    """QLoRA: the target linears' frozen weights to NF4 (torchao), in place. Their values must be
    final (initialised or loaded): NF4 cannot be loaded into. A weight too small for 256 blocks
    (only toy models have one) double-quantizes its scales in smaller groups."""
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)  # its GPU kernels' libraries, absent on a CPU
    from torchao.quantization import to_nf4

    for m in lora_modules(model):
        if is_nf4(m.weight):
            continue
        blocks = m.weight.numel() // NF4_BLOCK
        scaler_block = next(s for s in (NF4_SCALER_BLOCK >> k for k in range(9)) if blocks % s == 0)
        weight = m.weight.detach().to(torch.bfloat16)
        m.weight = nn.Parameter(to_nf4(weight, NF4_BLOCK, scaler_block), requires_grad=False)


def is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """A weight in fp32, an NF4 one dequantized."""
    weight = weight.detach()
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    return (weight.get_original_weight() if is_nf4(weight) else weight).float()


def init_adapter(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A as nn.Linear's default (Kaiming-uniform, bound 1 / sqrt(in)), as peft does; B zero."""
    if name.endswith("lora_b"):
        return torch.zeros(shape)
    bound = 1 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def target_weights(shape, spec: LoraSpec) -> list:
    """The target linears' weights (model.shapes.Param) of a model of `shape` (model.shapes.Shape)."""
    targets = tuple(f".{name}.weight" for name in spec.targets)
    return [p for p in shape.parameters() if p.name.endswith(targets)]


def adapter_count(shape, spec: LoraSpec) -> int:
    """Parameters of the adapters on a model of `shape`: r (in + out) per target."""
    return sum(spec.rank * sum(p.shape) for p in target_weights(shape, spec))


def merge_state_dict(state: dict[str, torch.Tensor], spec: LoraSpec) -> tuple[dict, dict]:
    """A full state dict of an adapted model -> (the base's names with B A merged into their weights,
    the adapters alone)."""
    adapters = {k: v for k, v in state.items() if k.endswith(ADAPTER_NAMES)}
    merged = {}
    for name, value in state.items():
        if name in adapters:
            continue
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{prefix}.lora_a" in adapters:
            delta = adapters[f"{prefix}.lora_b"].float() @ adapters[f"{prefix}.lora_a"].float()
            merged[name] = dequantized(value) + spec.scale * delta
        else:
            merged[name] = dequantized(value) if is_nf4(value) else value
    return merged, adapters
