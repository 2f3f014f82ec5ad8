"""Model states per rank, exact: which parameters a rank holds (its pipeline stages, its tensor-parallel
slice, its FSDP shard of dim 0, its ZeRO-1 share of the optimizer states) and their bytes, from the
parameter table (model/shapes.py) and the sharding rules meshtrain applies (meshtrain.layout).

meshtrain's mixed precision: the fp32 parameters are the master weights (bf16/fp16 copies exist only
while computing), gradients are fp32, AdamW keeps two fp32 moments: 4 + 4 + 8 = 16 bytes per
parameter, the same 16 as the ZeRO paper's 2 + 2 + 12 with the fp32 master counted as the parameter.
ZeRO-1 shards the moments (whole tensors, greedily, as ZeroRedundancyOptimizer does); ZeRO-2/3
(FSDP2) shard parameters, gradients and moments along dim 0; CPU offload (ZeRO-3) keeps all three in
host memory. Under context parallelism the cp ranks of a sequence are data-parallel ranks for the
states: ZeRO-1 partitions over DP x CP, FSDP shards over dp_shard x cp (Layout.shard_ranks).

LoRA/QLoRA (model/lora.py): only the adapters A (r x in) and B (out x r) of each target linear train,
with the same 16 bytes a parameter, sharded like the layout (TP splits B with a column-parallel
linear's outputs, A with a row-parallel one's inputs). The frozen base has no gradient and no moments;
its matrices are stored in bf16 under bf16 training (they need no fp32 master), its vectors (norms)
as they are; QLoRA stores the target linears' weights in NF4 (NF4_BYTES).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from meshtrain.layout import Layout, zero1_partition
from meshtrain.model.args import LoraSpec
from meshtrain.model.shapes import COLUMN, ROW, Param, Shape
from meshtrain.plan.workload import Workload

STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # per local parameter element
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's to_nf4 defaults, which QLoRA uses


def nf4_bytes(numel: int) -> int:
    """Bytes of torchao's NF4Tensor of `numel` elements: 4-bit codes, an int8 scale per block of 64,
    a bf16 factor per 256 of those scales, the 16-entry bf16 code table and a bf16 mean (a
    1024 x 1024 weight: 540,834 bytes, 0.5158 a parameter, as measured)."""
    blocks = -(-numel // NF4_BLOCK)
    return -(-numel // 2) + blocks + 2 * -(-blocks // NF4_SCALER_BLOCK) + 2 * 16 + 2


def _chunk(n: int, parts: int, index: int) -> int:
    """The length of piece `index` when torch.chunk splits n into `parts` (what DTensor's Shard does)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def local_numel(p: Param, layout: Layout, tp_rank: int, shard_rank: int) -> int:
    """Elements of a parameter one rank holds: its tensor-parallel slice, then its FSDP shard of dim 0
    (`shard_rank`: the rank's place among the dp_shard x cp ranks FSDP shards over, Layout.coordinates'
    "shard"); an expert's: its expert-parallel share of the experts, then its FSDP shard of dim 1 among
    the ranks holding the same experts."""
    if layout.ep > 1 and ".experts." in p.name:  # EP splits dim 0; FSDP shards dim 1 (evenly: job/layout.py)
        holders = layout.expert_replicas if layout.fsdp else 1
        experts, rows, *rest = p.shape
        return experts // layout.ep * (rows // holders) * math.prod(rest)
    if not layout.fsdp:
        return _local_numel(p.shape, p.tp_dim, layout.tp, tp_rank, 1, 0)
    return _local_numel(p.shape, p.tp_dim, layout.tp, tp_rank, layout.shard_ranks, shard_rank)


@functools.cache
def _local_numel(
    shape: tuple[int, ...], tp_dim: int | None, tp: int, tp_rank: int, shards: int, shard_rank: int
) -> int:
    dims = list(shape)
    if tp > 1 and tp_dim is not None:
        dims[tp_dim] = _chunk(dims[tp_dim], tp, tp_rank)
    dims[0] = _chunk(dims[0], shards, shard_rank)
    return math.prod(dims)


def stage_params(shape: Shape, layout: Layout, pp_rank: int) -> tuple[Param, ...]:
    """The parameters of the stages a pipeline rank holds, in the order its optimizer sees them."""
    return _stage_params(
        shape, Layout(pp=layout.pp, pp_schedule=layout.pp_schedule, pp_virtual_stages=layout.pp_virtual_stages), pp_rank
    )


@functools.cache
def _stage_params(shape: Shape, pipeline: Layout, pp_rank: int) -> tuple[Param, ...]:
    blocks = {i for stage in pipeline.stage_layers(shape.n_layers, pp_rank) for i in stage}
    owners = blocks | ({"embed"} if pipeline.holds_first_stage(pp_rank) else set())
    owners |= {"head"} if pipeline.holds_last_stage(pp_rank) else set()
    params = tuple(p for p in shape.parameters() if p.owner in owners)
    if shape.tie_embeddings and pipeline.pp > 1 and "head" in owners:  # Megatron and meshtrain keep a
        params += (Param("output.weight", (shape.vocab_size, shape.dim), "head", 0),)  # copy on the last stage
    return params


def model_state_bytes(
    shape: Shape, layout: Layout, rank: int = 0, peft: LoraSpec | None = None, dtype: str = "bf16"
) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes one rank holds (what memory.json measures).
    `peft`: LoRA/QLoRA adapters train on a frozen base stored in `dtype` (training.dtype)."""
    if peft is None:
        return _model_state_bytes(shape, _sharding(layout), rank)
    return _peft_state_bytes(shape, _sharding(layout), rank, peft, dtype)


def is_target(p: Param, peft: LoraSpec) -> bool:
    """A target linear's weight (layers.N.attention.wq.weight, ...)."""
    parts = p.name.split(".")
    return isinstance(p.owner, int) and parts[-1] == "weight" and len(p.shape) == 2 and parts[-2] in peft.targets


def adapters(params: tuple[Param, ...], peft: LoraSpec) -> tuple[Param, ...]:
    """The adapters of the target linears among `params`: A (r x in) split with a row-parallel
    linear's inputs, B (out x r) with a column-parallel linear's outputs, else replicated."""
    out = []
    for p in params:
        if is_target(p, peft):
            rows, cols = p.shape
            prefix = p.name.removesuffix(".weight")
            out.append(Param(f"{prefix}.lora_a", (peft.rank, cols), p.owner, 1 if p.tp_dim == ROW else None))
            out.append(Param(f"{prefix}.lora_b", (rows, peft.rank), p.owner, 0 if p.tp_dim == COLUMN else None))
    return tuple(out)


def frozen_bytes(p: Param, numel: int, peft: LoraSpec, dtype: str) -> float:
    """Storage of a frozen base parameter's local `numel` elements: NF4 for QLoRA's targets (never
    sharded), bf16 matrices under bf16 training, the rest (norms; everything under fp32) fp32."""
    if peft.quantized and is_target(p, peft):
        return nf4_bytes(numel)
    return (2 if dtype != "fp32" and len(p.shape) >= 2 else 4) * numel


@functools.cache
def _peft_state_bytes(shape: Shape, layout: Layout, rank: int, peft: LoraSpec, dtype: str) -> dict[str, int]:
    c = layout.coordinates(rank)
    params = stage_params(shape, layout, c["pp"])
    base = sum(frozen_bytes(p, local_numel(p, layout, c["tp"], c["shard"]), peft, dtype) for p in params)
    local = [(local_numel(a, layout, c["tp"], c["shard"]), True) for a in adapters(params, peft)]
    held = sum(n for n, _ in local)
    moments = zero1_partition(local, layout.dp_cp)[_zero1_index(layout, c)] if _zero1(layout) else held
    return {
        "params": int(base) + STATE_BYTES["params"] * held,
        "grads": STATE_BYTES["grads"] * held,
        "optimizer": STATE_BYTES["optimizer"] * moments,
    }


def _zero1(layout: Layout) -> bool:
    """ZeroRedundancyOptimizer partitions the moments, over the DP x CP ranks the gradients average over."""
    return layout.zero == 1 and layout.dp_cp > 1


def _zero1_index(layout: Layout, c: dict[str, int]) -> int:
    """A rank's place in the flattened dp x cp group its optimizer is partitioned over (cp innermost)."""
    return c["dp"] * layout.cp + c["cp"]


def _sharding(layout: Layout) -> Layout:
    """The fields that decide who holds which parameter (a cache key)."""
    return Layout(
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        zero=layout.zero,
        ep=layout.ep,
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
    )


@dataclass(frozen=True)
class StageSums:
    """Elements of a pipeline rank's parameters after tensor parallelism (before FSDP sharding)."""

    total: int
    linear: int  # 2-D weights that multiply activations (autocast copies them), not the embedding
    block_linear: int  # those of the blocks (wq wk wv wo w1 w2 w3: what training.fp8 computes in FP8)
    blocks: tuple[int, ...]
    outer: int  # embedding, final norm, output: FSDP's root group
    block_full: int  # one block before any split, the parameters a token multiplies (its FLOPs)


def stage_sums(shape: Shape, layout: Layout, pp_rank: int) -> StageSums:
    return _stage_sums(
        shape,
        Layout(tp=layout.tp, pp=layout.pp, pp_schedule=layout.pp_schedule, pp_virtual_stages=layout.pp_virtual_stages),
        pp_rank,
    )


@functools.cache
def _stage_sums(shape: Shape, layout: Layout, pp_rank: int) -> StageSums:
    params = stage_params(shape, layout, pp_rank)
    tp_only = Layout(tp=layout.tp)
    local = [local_numel(p, tp_only, 0, 0) for p in params]
    owners = sorted({p.owner for p in params if isinstance(p.owner, int)})
    matrices = [(p, n) for p, n in zip(params, local, strict=True) if len(p.shape) == 2]
    return StageSums(
        total=sum(local),
        linear=sum(n for p, n in matrices if p.owner != "embed"),
        block_linear=sum(n for p, n in matrices if isinstance(p.owner, int)),
        blocks=tuple(sum(n for p, n in zip(params, local, strict=True) if p.owner == i) for i in owners),
        outer=sum(n for p, n in zip(params, local, strict=True) if not isinstance(p.owner, int)),
        # a mixture of experts' block multiplies its active parameters only (and its blocks may differ:
        # dense first layers), so the mean over the stage's blocks
        block_full=round(sum(shape.active_numel(p) for p in params if isinstance(p.owner, int)) / max(1, len(owners))),
    )


def trainable_sums(w: Workload, layout: Layout, pp_rank: int) -> StageSums:
    """stage_sums of what trains: every parameter, or under LoRA/QLoRA the adapters."""
    if w.peft is None:
        return stage_sums(w.shape, layout, pp_rank)
    return _adapter_sums(
        w.shape,
        w.peft,
        Layout(tp=layout.tp, pp=layout.pp, pp_schedule=layout.pp_schedule, pp_virtual_stages=layout.pp_virtual_stages),
        pp_rank,
    )


@functools.cache
def _adapter_sums(shape: Shape, peft: LoraSpec, layout: Layout, pp_rank: int) -> StageSums:
    params = stage_params(shape, layout, pp_rank)
    ads = adapters(params, peft)
    tp_only = Layout(tp=layout.tp)
    local = [local_numel(a, tp_only, 0, 0) for a in ads]
    owners = sorted({a.owner for a in ads})
    return StageSums(
        total=sum(local),
        linear=sum(local),
        block_linear=0,  # adapters train in the training dtype (training.fp8 refuses [peft])
        blocks=tuple(sum(n for a, n in zip(ads, local, strict=True) if a.owner == i) for i in owners),
        outer=0,
        block_full=sum(a.numel for a in ads if owners and a.owner == owners[0]),
    )


def largest_target(w: Workload, layout: Layout, pp_rank: int) -> int:
    """Elements of the largest target linear weight a pipeline rank holds (after TP): QLoRA
    dequantizes one at a time to bf16, in forward and again in backward."""
    if w.peft is None:
        return 0
    params = stage_params(w.shape, layout, pp_rank)
    return max((local_numel(p, Layout(tp=layout.tp), 0, 0) for p in params if is_target(p, w.peft)), default=0)


def target_elements(w: Workload, layout: Layout, pp_rank: int) -> int:
    """Elements of the target linear weights a pipeline rank holds (after TP)."""
    if w.peft is None:
        return 0
    params = stage_params(w.shape, layout, pp_rank)
    return sum(local_numel(p, Layout(tp=layout.tp), 0, 0) for p in params if is_target(p, w.peft))


@functools.cache
def _model_state_bytes(shape: Shape, layout: Layout, rank: int) -> dict[str, int]:
    c = layout.coordinates(rank)
    params = stage_params(shape, layout, c["pp"])
    local = [(local_numel(p, layout, c["tp"], c["shard"]), len(p.shape) >= 2) for p in params]
    held = sum(n for n, _ in local)
    moments = zero1_partition(local, layout.dp_cp)[_zero1_index(layout, c)] if _zero1(layout) else held
    grads = held
    if layout.tp > 1 and not layout.fsdp:  # DTensor's vocabulary-parallel embedding: its gradient comes back whole
        grads += sum(p.numel - n for p, (n, _) in zip(params, local, strict=True) if p.name == "tok_embeddings.weight")
    return {
        "params": STATE_BYTES["params"] * held,
        "grads": STATE_BYTES["grads"] * grads,
        "optimizer": STATE_BYTES["optimizer"] * moments,
    }


def host_state_bytes(w: Workload, layout: Layout) -> int:
    """Host memory one rank's model states take under CPU offload (FSDP2's CPUOffloadPolicy: the
    fp32 parameter shards, their fp32 gradients and AdamW's two fp32 moments, pinned), the most of
    any pipeline rank; 0 without offload."""
    if not layout.cpu_offload:
        return 0
    ranks = (pp_rank * (layout.world // layout.pp) for pp_rank in range(layout.pp))
    return max(sum(model_state_bytes(w.shape, layout, rank, w.peft, w.dtype).values()) for rank in ranks)
