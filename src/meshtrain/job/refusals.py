"""What a layout cannot run for a job's model and settings, in the words the user reads: CUDA graphs
beyond one process, FP8 shards that do not divide into torch._scaled_mm's 16s, QLoRA's NF4 blocks and
its whole base per rank, DPO in a pipeline. The trainer raises these (job resolution); the planner's
search drops a layout for the same reason, word for word."""

from __future__ import annotations

from meshtrain.layout import Layout
from meshtrain.model.args import LoraSpec
from meshtrain.model.shapes import BLOCK_SHARDED_DIM, Shape


def layout_refusal(
    shape: Shape, layout: Layout, lora: LoraSpec | None, objective: str, fp8: str, cuda_graphs: bool
) -> str:
    """Why meshtrain cannot train this model on this layout ("" if it can)."""
    if cuda_graphs and layout.world > 1:
        # CUDA graphs replay the whole-model graph of one process (parallel/compile.py): the per-block
        # graphs of DP, FSDP and PP interleave with their communication hooks, which a graph cannot
        # capture, and TP's whole-model graph holds collectives whose capture has not been tested.
        return (
            f"training.cuda_graphs replays the whole-model graph of one process, but this layout has {layout.world} "
            "ranks: drop training.cuda_graphs, or train on one GPU"
        )
    if problem := fp8_shape_refusal(shape, layout.tp, fp8) or nf4_refusal(shape, lora):
        return problem
    if shape.moe_layers and layout.tp > 1:
        return (
            f"parallel.tp = {layout.tp} with a mixture of experts: tensor parallelism of MoE layers is not built; "
            "split the model with ZeRO-3 (parallel.zero = 3) or a pipeline (parallel.pp) instead"
        )
    if objective == "dpo" and layout.pp > 1:
        return "training.objective = dpo is not implemented for pipelines (parallel.pp > 1): use ZeRO-3 or TP"
    if lora is None or not lora.quantized:
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
    return (
        f"peft.method = qlora keeps a whole 4-bit base on each rank, so it runs on one process or plain DDP "
        f"(parallel.zero 0 or 1), not with {', '.join(used)}: use such a layout, or peft.method = lora, which "
        "shards its base with ZeRO-3 and TP"
    )


def fp8_shape_refusal(shape: Shape, tp: int, fp8: str) -> str:
    """training.fp8 runs every linear of the blocks in FP8: each one's shard on a rank (split by TP)
    must divide into the 16s torch._scaled_mm multiplies, or it would silently stay in bf16."""
    if fp8 == "off":
        return ""
    from meshtrain.parallel.float8 import GEMM_MULTIPLE  # (torch: loaded where FP8 is asked for)

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
