"""What the planner plans beside a layout (meshtrain.layout, the trainer's own): the workload, the
model, tokens per sequence, the kernels that run it (FP8 included), and what trains (every weight, or LoRA/QLoRA
adapters on a frozen base) on which objective."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.model.args import LoraSpec
from meshtrain.model.shapes import Shape


@dataclass(frozen=True)
class Workload:
    """What is trained, and how: the model, tokens per sequence, precision (bf16 storage with fp32
    GEMMs: `fp32_arithmetic`, with fp32 attention: `fp32_attention`; training.bf16_compute), the
    device type whose kernels run the step (CUDA fuses RMSNorm into one kernel that saves less than
    the CPU's composite one) and whether the blocks and the loss are compiled (training.compile:
    inductor keeps fewer, fused tensors for backward). `peft`: [peft] resolved
    (`LoraSpec.from_config(cfg.peft)`; None: every weight trains); `objective`: training.objective
    ("dpo": each batch element is a pair of sequences, and a no-grad reference forward runs per
    micro-batch). `fp8`: training.fp8, the blocks' linears computed in FP8 (torchao). `cuda_graphs`:
    training.cuda_graphs, which removes host launch time the estimate does not count, but holds the
    job to one GPU. The batch, its split and CPU offload are the layout's."""

    shape: Shape
    seq_len: int
    dtype: str = "bf16"
    fp32_arithmetic: bool = False
    attention: str = "flash"  # "math" materialises the s x s scores (GPT arch without flash attention)
    device: str = "cuda"  # "cuda" or "cpu"
    compiled: bool = False
    fp32_attention: bool = False
    peft: LoraSpec | None = None
    objective: str = "lm"
    fp8: str = "off"  # "tensorwise" or "rowwise"
    cuda_graphs: bool = False

    @property
    def sequences(self) -> int:
        """Sequences per batch element: a DPO pair is two (chosen, rejected)."""
        return 2 if self.objective == "dpo" else 1

    @property
    def quantized(self) -> bool:
        return self.peft is not None and self.peft.quantized


def fp8_shape_refusal(shape: Shape, tp: int, fp8: str) -> str:
    """training.fp8 runs every linear of the blocks in FP8: each one's shard on a rank (split by TP)
    must divide into the 16s torch._scaled_mm multiplies, or it would silently stay in bf16."""
    if fp8 == "off":
        return ""
    from meshtrain.model.shapes import BLOCK_SHARDED_DIM
    from meshtrain.parallel.float8 import GEMM_MULTIPLE

    linears = tuple(f".{name}.weight" for name in BLOCK_SHARDED_DIM)
    for p in shape.parameters():
        if isinstance(p.owner, int) and p.name.endswith(linears):
            local = [d // tp if i == p.tp_dim else d for i, d in enumerate(p.shape)]
            if any(d % GEMM_MULTIPLE for d in local):
                return (
                    f"training.fp8 runs the blocks' linears in FP8, whose GEMMs need dimensions divisible by "
                    f"{GEMM_MULTIPLE}, but {p.name} is {tuple(local)} on each rank: resize the model or set "
                    "training.fp8 = off"
                )
    return ""


def nf4_refusal(shape: Shape, lora: LoraSpec | None) -> str:
    """QLoRA stores each target weight in NF4 blocks of 64 weights, which must divide it."""
    if lora is None or not lora.quantized:
        return ""
    from meshtrain.model.lora import NF4_BLOCK, target_weights

    odd = [p for p in target_weights(shape, lora) if p.numel % NF4_BLOCK]
    if not odd:
        return ""
    return (
        f"peft.method = qlora stores weights in blocks of {NF4_BLOCK}, but {odd[0].name} {odd[0].shape} "
        "does not divide into them: leave that linear out of peft.targets, or use peft.method = lora"
    )


def cuda_graphs_refusal(layout) -> str:
    """CUDA graphs replay the whole-model graph of one process (parallel/compile.py): the per-block
    graphs of DP, FSDP and PP interleave with their communication hooks, which a graph cannot capture,
    and TP's whole-model graph holds collectives whose capture has not been tested."""
    if layout.world == 1:
        return ""
    return (
        f"training.cuda_graphs replays the whole-model graph of one process, but this layout has {layout.world} "
        "ranks: drop training.cuda_graphs, or train on one GPU"
    )


def workload_refusal(w: Workload, layout) -> str:
    """Why meshtrain cannot train this workload on this layout ("" if it can), as its preflight
    says: DPO does not run in pipelines; QLoRA's NF4 weights run on one process or plain DDP
    (ZeRO-0/1), not under FSDP, TP or PP, and in blocks that divide its weights; FP8's GEMMs need
    shards that divide into 16s; CUDA graphs run on one process."""
    if w.cuda_graphs and (problem := cuda_graphs_refusal(layout)):
        return problem
    if problem := fp8_shape_refusal(w.shape, layout.tp, w.fp8) or nf4_refusal(w.shape, w.peft):
        return problem
    if w.objective == "dpo" and layout.pp > 1:
        return "training.objective dpo is not implemented for pipelines (pp > 1)"
    if not w.quantized:
        return ""
    used = [
        name
        for name, on in (
            (f"tp {layout.tp}", layout.tp > 1),
            (f"pp {layout.pp}", layout.pp > 1),
            (f"zero {layout.zero} (FSDP)", layout.fsdp),
        )
        if on
    ]
    if not used:
        return ""
    return f"peft.method qlora runs on one process or plain DDP (zero 0/1), not with {', '.join(used)}"


def workload_of_config(cfg, shape: Shape, device: str = "cuda") -> Workload:
    """A resolved training config's workload (its arithmetic resolved, train/arithmetic.py), with
    its [peft] and objective: what the trainer's preflight and plan_check should estimate."""
    from meshtrain.parallel.precision import fp32_classes

    t = cfg.training
    fp32_gemm, fp32_attention = fp32_classes(t)
    return Workload(
        shape,
        t.seq_len,
        t.dtype,
        fp32_gemm,
        device=device,
        compiled=t.compile,
        fp32_attention=fp32_attention,
        peft=LoraSpec.from_config(cfg.peft),
        objective=t.objective,
        fp8=t.fp8,
        cuda_graphs=t.cuda_graphs,
    )
