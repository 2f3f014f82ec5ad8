"""bf16 training with fp32 arithmetic, for CPUs whose bf16 kernels are slower than their fp32 ones.

Some CPUs multiply bf16 no faster than fp32: without AMX tiles an x86 core uses AVX512-BF16 dot
products, at or below the fp32 FMA rate (on a 2-core Xeon, oneDNN's bf16 GEMM reaches 0.15 TFLOP/s
against 0.25 for fp32, and the bf16 flash-attention backward is 3x slower than the fp32 one); others
(an AMD EPYC with AVX512-BF16) run bf16 GEMMs 3x faster than fp32, and on some of them the bf16
attention is still the slower one. `training.bf16_compute` picks, class by class, which work runs in
fp32 arithmetic ("auto": job/arithmetic.py times each choice at the model's shapes): everything
bf16 training stores stays bf16
(activations saved for backward, FSDP's gathered parameters, the tensors between layers) and the
inputs of every matmul are rounded to bf16 exactly as autocast does, but multiplied with fp32
instructions. A product of two bf16 numbers is exact in fp32 and bf16 GEMMs accumulate in fp32, so
a linear layer gives the bf16 GEMM's numbers up to summation order; attention is computed in fp32
from bf16 q, k and v (more exact than the bf16 kernel, which rounds the probabilities).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import MeshtrainError
from meshtrain.model.llama import Attention
from meshtrain.model.lora import LoRALinear, is_nf4

BF16 = torch.bfloat16

# training.bf16_compute -> (GEMMs in fp32 arithmetic, attention in fp32 arithmetic), under bf16 storage.
FP32_CLASSES = {
    "bf16": (False, False),
    "fp32": (True, True),
    "bf16-gemm": (False, True),
    "bf16-attention": (True, False),
}


def fp32_classes(training) -> tuple[bool, bool]:
    """(GEMMs, attention) computed in fp32 arithmetic on bf16 storage, for a training config whose
    "auto" values were resolved (job/arithmetic.py); plain fp32 training swaps nothing."""
    if training.dtype == "auto" or (training.dtype == "bf16" and training.bf16_compute == "auto"):
        raise MeshtrainError(
            "training.dtype / bf16_compute are still 'auto': resolve them with meshtrain.job.arithmetic.resolve first"
        )
    return FP32_CLASSES[training.bf16_compute] if training.dtype == "bf16" else (False, False)


def arithmetic_label(training) -> str:
    """What the step computes in (logged with the metrics): "fp32", or bf16 storage with the
    bf16_compute choice ("bf16", "fp32", "bf16-gemm", "bf16-attention") as "bf16/<choice>"."""
    fp8 = getattr(training, "fp8", "off")  # a job/arithmetic.Choice has none
    fp8 = "" if fp8 == "off" else f"+fp8-{fp8}"
    if training.dtype in ("fp32", "fp16"):
        return training.dtype + fp8
    fp32_classes(training)  # resolved
    return ("bf16" if training.bf16_compute == "bf16" else f"bf16/{training.bf16_compute}") + fp8


class _Bf16LinearInFp32(torch.autograd.Function):
    """y = round_bf16(x) @ round_bf16(w).T in fp32, returned in bf16; saves only the bf16 inputs that
    backward needs: x for a weight that trains, w for an x that does (a frozen LoRA base keeps no
    input; QLoRA's NF4 weight is kept as it is and dequantised again, as torchao's own linear does)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        with torch.autocast(x.device.type, enabled=False):
            x16, w16 = x.to(BF16), weight.to(BF16)
            kept_w = weight if is_nf4(weight) else w16
            ctx.save_for_backward(x16 if ctx.needs_input_grad[1] else None, kept_w if ctx.needs_input_grad[0] else None)
            ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
            out = x16.float() @ w16.float().t()
            if bias is not None:
                out = out + bias.to(BF16).float()
            return out.to(BF16)

    @staticmethod
    def backward(ctx, grad_out):
        x16, kept_w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        with torch.autocast(grad_out.device.type, enabled=False):
            g = grad_out.float()
            grad_x = (g @ kept_w.float()).to(x_dtype) if ctx.needs_input_grad[0] else None
            g2d = g.flatten(0, -2)
            grad_w = (g2d.t() @ x16.float().flatten(0, -2)).to(w_dtype) if ctx.needs_input_grad[1] else None
            grad_b = g2d.sum(0).to(b_dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, with a bf16 matmul (under autocast, or on bf16 inputs) run in fp32 arithmetic."""
    if x.dtype == BF16 or torch.is_autocast_enabled(x.device.type):
        return _Bf16LinearInFp32.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Fp32ComputeLinear(nn.Linear):
    """nn.Linear whose bf16 matmuls run in fp32 (fp32_linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_linear(x, self.weight, self.bias)


class Fp32ComputeLoRALinear(LoRALinear):
    """LoRALinear whose bf16 matmuls, the frozen base's and the adapters', run in fp32 as
    Fp32ComputeLinear's do. QLoRA's NF4 base is dequantised to its bf16 values for each of them
    (and kept in NF4 for backward, as torchao's own linear keeps it)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp32_linear(x, weight, bias)


# the linears fp32 GEMM arithmetic swaps: exactly these classes (a subclass has forwards of its own)
FP32_LINEARS = {nn.Linear: Fp32ComputeLinear, LoRALinear: Fp32ComputeLoRALinear}


class Fp32ComputeAttention(Attention):
    """Attention whose scaled-dot-product kernel runs in fp32 on the (bf16) q, k and v."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        if q.dtype != BF16 and not torch.is_autocast_enabled(q.device.type):
            return super().attend(q, k, v, mask)
        with torch.autocast(q.device.type, enabled=False):
            return super().attend(q.to(BF16).float(), k.to(BF16).float(), v.to(BF16).float(), mask).to(BF16)


def apply_fp32_compute(model: nn.Module, gemm: bool = True, attention: bool = True) -> None:
    """Swap the classes of the model's linear (`gemm`: plain and LoRA's) and attention (`attention`)
    modules in place (parameters, names and hooks unchanged). Before tensor parallelism: its plans
    match nn.Linear subclasses too."""
    for module in model.modules():
        if gemm and type(module) in FP32_LINEARS:
            module.__class__ = FP32_LINEARS[type(module)]
        elif attention and type(module) is Attention:
            module.__class__ = Fp32ComputeAttention
