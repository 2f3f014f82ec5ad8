"""Bytes per GPU, item by item: model states (exact, from the parameter table and the sharding
rules meshtrain applies), activations (from the tensors autograd saves, per block), pipeline
in-flight micro-batches, logits and loss, communication buffers and the allocator's slack.

Model states follow meshtrain's mixed precision: the fp32 parameters are the master weights (bf16
copies exist only while computing), gradients are fp32, AdamW keeps two fp32 moments: 4 + 4 + 8 =
16 bytes per parameter, the same 16 as the ZeRO paper's 2 + 2 + 12 with the fp32 master counted as
the parameter. ZeRO-1 shards the moments (whole tensors, greedily, as ZeroRedundancyOptimizer
does); ZeRO-2/3 (FSDP2) shard parameters, gradients and moments along dim 0.

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
from meshtrain.model.lora import LoraSpec
from meshtrain.model.shapes import COLUMN, ROW, Param, Shape
from meshtrain.plan.saved import Precision, adapter_saved, compiled_llama_block, gpt_block, llama_block, per_token_bytes
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
    """Elements of a parameter one rank holds: its tensor-parallel slice, then its FSDP shard of dim 0."""
    if not layout.fsdp:
        return _local_numel(p.shape, p.tp_dim, layout.tp, tp_rank, 1, 0)
    return _local_numel(p.shape, p.tp_dim, layout.tp, tp_rank, layout.dp_shard, shard_rank)


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
    base = sum(frozen_bytes(p, local_numel(p, layout, c["tp"], c["dp_shard"]), peft, dtype) for p in params)
    local = [(local_numel(a, layout, c["tp"], c["dp_shard"]), True) for a in adapters(params, peft)]
    held = sum(n for n, _ in local)
    moments = zero1_partition(local, layout.dp)[c["dp"]] if layout.zero == 1 and layout.dp > 1 else held
    return {
        "params": int(base) + STATE_BYTES["params"] * held,
        "grads": STATE_BYTES["grads"] * held,
        "optimizer": STATE_BYTES["optimizer"] * moments,
    }


def _sharding(layout: Layout) -> Layout:
    """The fields that decide who holds which parameter (a cache key)."""
    return Layout(
        tp=layout.tp,
        pp=layout.pp,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        zero=layout.zero,
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
    )


@dataclass(frozen=True)
class StageSums:
    """Elements of a pipeline rank's parameters after tensor parallelism (before FSDP sharding)."""

    total: int
    linear: int  # 2-D weights that multiply activations (autocast copies them), not the embedding
    blocks: tuple[int, ...]
    outer: int  # embedding, final norm, output: FSDP's root group
    block_full: int  # one block before any split (its FLOPs)


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
    return StageSums(
        total=sum(local),
        linear=sum(n for p, n in zip(params, local, strict=True) if len(p.shape) == 2 and p.owner != "embed"),
        blocks=tuple(sum(n for p, n in zip(params, local, strict=True) if p.owner == i) for i in owners),
        outer=sum(n for p, n in zip(params, local, strict=True) if not isinstance(p.owner, int)),
        block_full=sum(p.numel for p in params if owners and p.owner == owners[0]),
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
    local = [(local_numel(p, layout, c["tp"], c["dp_shard"]), len(p.shape) >= 2) for p in params]
    held = sum(n for n, _ in local)
    moments = zero1_partition(local, layout.dp)[c["dp"]] if layout.zero == 1 and layout.dp > 1 else held
    grads = held
    if layout.tp > 1 and not layout.fsdp:  # DTensor's vocabulary-parallel embedding: its gradient comes back whole
        grads += sum(p.numel - n for p, (n, _) in zip(params, local, strict=True) if p.name == "tok_embeddings.weight")
    return {
        "params": STATE_BYTES["params"] * held,
        "grads": STATE_BYTES["grads"] * grads,
        "optimizer": STATE_BYTES["optimizer"] * moments,
    }


# ---------------------------------------------------------------------------------------------
# Activations. Each entry is one tensor autograd keeps for backward, per token of a micro-batch:
# (what, elements, bytes per element, split) where split says how tensor parallelism divides it:
# "tp" always (a head- or hidden-sharded tensor), "sp" only under sequence parallelism (norms and
# residuals), "full" never (a column-parallel layer's all-gathered input, which DTensor saves whole).


def block_bytes_per_token(w: Workload, layout: Layout) -> float:
    """What one block keeps for backward, per token of a micro-batch, on one tensor-parallel rank."""
    shape = w.shape
    if shape.arch == "gpt":
        return per_token_bytes(gpt_block(shape, w), layout)
    prec = Precision.of(w, layout.fsdp)
    lora = adapter_saved(shape, prec, w.peft) if w.peft else []
    if w.compiled:
        return per_token_bytes(compiled_llama_block(shape, prec) + lora, layout)
    return per_token_bytes(llama_block(shape, prec, w.device == "cuda", w.peft) + lora, layout)


def checkpointed_block_bytes_per_token(w: Workload, layout: Layout) -> float:
    """A checkpointed block keeps only its input."""
    stream = Precision.of(w, layout.fsdp).stream if w.shape.arch == "llama" else (4 if w.dtype == "fp32" else 2)
    return w.shape.dim * stream / (layout.tp if layout.sequence_parallel else 1)


def ends_bytes_per_token(w: Workload, layout: Layout, first: bool, last: bool) -> float:
    """The token ids (first stage); the final norm, the output layer's input and what the loss keeps
    with its targets (last stage): eager, the fp32 log-softmax; compiled, the logits themselves."""
    total = 8.0 if first else 0.0
    if last:
        h, t = w.shape.dim, layout.tp
        linear_input = _half_bytes(w)
        sp = t if layout.sequence_parallel else 1
        frozen = w.peft is not None  # a frozen output layer keeps no input, a frozen norm no normalised one
        norm = (h * 4 + 4) if w.device == "cuda" or w.compiled or frozen else (2 * h * 4 + 4)
        loss = linear_input if w.compiled else 4
        total += norm / sp + (0 if frozen else h * linear_input) + loss * _vocab(w, layout) + 8
    return total


def _vocab(w: Workload, layout: Layout) -> float:
    """Logit columns one rank holds: the vocabulary, split under loss parallelism."""
    return w.shape.vocab_size / (layout.tp if layout.loss_parallel else 1)


def logits_working_bytes_per_token(w: Workload, layout: Layout) -> float:
    """On top of what the loss saved, at its backward: eager, log-softmax's two fp32 gradients (its
    output's, from nll_loss, and its input's; the logits and their fp32 copy are gone by then), one
    under loss parallelism (DTensor's vocabulary-parallel loss makes the input's in one step);
    compiled, one gradient of the logits, computed in one fused kernel."""
    if w.compiled:
        return _vocab(w, layout) * _half_bytes(w)
    return _vocab(w, layout) * (4 if layout.tp > 1 and layout.loss_parallel else 8)


def in_flight(layout: Layout, micro_batches: int) -> float:
    """Micro-batches (in units of a whole rank's share of the layers) whose activations the busiest
    pipeline rank holds at once: 1 without PP; GPipe all m; 1F1B up to pp; the interleaved
    schedules count chunks of 1/v of the rank's layers: warm-up (v-1)pp + 2(pp-1) chunks plus one."""
    p, v, m = layout.pp, layout.stages_per_rank, micro_batches
    if p == 1:
        return 1
    if layout.pp_schedule == "gpipe":
        return m
    if v == 1:
        return min(m, p)
    chunks = min(m * v, (v - 1) * p + 2 * (p - 1) + 1)
    return chunks / v


def activation_bytes(w: Workload, layout: Layout, pp_rank: int = 0) -> dict[str, float]:
    """Bytes of saved activations on one rank at the peak of a step, and the transient working
    set on top of them (the logits' gradient; one checkpointed block recomputed in backward; DPO's
    no-grad reference forward: one block's working set and the logits with their fp32 log-softmax)."""
    tokens = layout.micro_batch_size * w.seq_len * w.sequences
    layers = [n for stage in layout.stage_layers(w.shape.n_layers, pp_rank) for n in stage]
    full, ckpt = block_bytes_per_token(w, layout), checkpointed_block_bytes_per_token(w, layout)
    if layout.activation_checkpointing == "full":
        checkpointed = len(layers)
    elif layout.activation_checkpointing == "selective":
        checkpointed = len(layers[:: layout.ac_every])
    else:
        checkpointed = 0
    first, last = layout.holds_first_stage(pp_rank), layout.holds_last_stage(pp_rank)
    per_micro_batch = tokens * (checkpointed * ckpt + (len(layers) - checkpointed) * full)
    saved = per_micro_batch * in_flight(layout, layout.micro_batches) + tokens * ends_bytes_per_token(
        w, layout, first, last
    )
    recompute = tokens * full if checkpointed else 0.0
    logits = tokens * logits_working_bytes_per_token(w, layout) if last else 0.0
    return {
        "saved": saved,
        "per_micro_batch": per_micro_batch,
        "recompute": recompute,
        "logits": logits,
        # at the output layer's backward: the logits' gradient; what the loss saved is freed by then
        "logits_grad": tokens * _vocab(w, layout) * _half_bytes(w) if last else 0.0,
        "loss_freed": tokens * _vocab(w, layout) * (_half_bytes(w) if w.compiled else 4) if last else 0.0,
        "transient": max(recompute, logits),
        "reference": tokens * (full + (_half_bytes(w) + 8) * _vocab(w, layout) * last) if w.objective == "dpo" else 0.0,
    }


def _half_bytes(w: Workload) -> int:
    return 4 if w.dtype == "fp32" else 2


def other_bytes(
    w: Workload, layout: Layout, pp_rank: int, runtime_gib: float, fragmentation: float, activations: float
) -> float:
    """Buffers besides model states, saved activations and FSDP's gathered parameters, on one rank
    for the whole step: autocast's bf16 weight copies (of the weights that train: it caches only
    leaves that require a gradient, so under LoRA the adapters'), DDP's gradient buckets (allocated
    with the reducer and kept; the gradients are views of them except while micro-batches accumulate
    under no_sync; under LoRA the adapters' only), QLoRA's bf16 dequantization of one target
    weight (DPO's reference is the base with the adapters off: no copy), the runtime's own memory
    (CUDA context, NCCL) and the caching allocator's fragmentation, as a fraction of the activations."""
    total = 0.0
    trainable = trainable_sums(w, layout, pp_rank)
    if w.dtype != "fp32" and not layout.fsdp and w.shape.arch == "llama":
        total += 2 * trainable.linear
    if ddp_buckets(layout):
        total += STATE_BYTES["grads"] * trainable.total
    if w.quantized:
        total += 2 * largest_target(w, layout, pp_rank)
    return total + runtime_gib * 2**30 + fragmentation * activations


def ddp_buckets(layout: Layout) -> bool:
    """Whether the trainer wraps the model in DDP: replicas (ZeRO-0/1) without pipelining."""
    return layout.dp > 1 and not layout.fsdp and layout.pp == 1


def fsdp_gathered_bytes(w: Workload, layout: Layout, pp_rank: int) -> dict[str, float]:
    """FSDP's all-gathered parameters at the moments a step peaks. At the loss's backward: ZeRO-2
    keeps the whole stage gathered from forward to backward, ZeRO-3 only the last block (resharding
    it would mean gathering it again at once). Then ZeRO-3 gathers the root group (embedding, norm,
    output) again for the output layer's backward: twice its size while the all-gather's buffer is
    copied out into the parameters. In the blocks' backward: the root group (kept until the
    embedding's backward), the block computing and the one prefetched, and one block's unsharded fp32
    gradients before their reduce-scatter."""
    if not layout.fsdp:
        return {"loss": 0.0, "root": 0.0, "blocks": 0.0}
    sums, trainable = stage_sums(w.shape, layout, pp_rank), trainable_sums(w, layout, pp_rank)
    half = _half_bytes(w)
    if w.peft is not None:  # the adapters are gathered with their block; only they have gradients
        blocks = [b + a for b, a in zip(sums.blocks, trainable.blocks, strict=False)] or list(sums.blocks)
        total = sums.total + trainable.total
    else:
        blocks, total = list(sums.blocks), sums.total
    largest, grads = max(blocks, default=0), max(trainable.blocks, default=0) * STATE_BYTES["grads"]
    if layout.zero == 2:
        return {"loss": total * half, "root": 0.0, "blocks": total * half + grads}
    return {
        "loss": largest * half,
        "root": (2 * sums.outer + largest) * half,
        "blocks": (sums.outer + 2 * largest) * half + grads,
    }


def unsharded_grad_bytes(w: Workload, layout: Layout, pp_rank: int) -> float:
    """FSDP reduce-scatters only after a step's last micro-batch: until then each rank accumulates
    whole (unsharded) fp32 gradients of its stage, and under TP the vocabulary-parallel embedding's
    comes back whole from DTensor."""
    grads = trainable_sums(w, layout, pp_rank).total
    if layout.tp > 1 and layout.holds_first_stage(pp_rank) and w.peft is None:
        grads += (w.shape.vocab_size - w.shape.vocab_size // layout.tp) * w.shape.dim
    return STATE_BYTES["grads"] * grads


def resident_grad_bytes(w: Workload, layout: Layout, pp_rank: int, grads: float) -> float:
    """Gradient bytes alive while the most activations are (`grads`: the rank's sharded gradients):
    none, those, or FSDP's unsharded ones while it accumulates micro-batches."""
    if not grads_resident(w, layout):
        return 0.0
    return unsharded_grad_bytes(w, layout, pp_rank) if layout.fsdp and layout.micro_batches > 1 else grads


def grads_resident(w: Workload, layout: Layout) -> bool:
    """Whether gradients already exist while the most activations are live: with gradient
    accumulation (the micro-batches after the first), and in a pipeline schedule with a steady phase
    (1F1B with more micro-batches than it keeps in flight: a backward has run when the next forward
    fills the pipeline again). Not under GPipe, whose first backward comes after every forward;
    otherwise gradients appear as backward frees the activations (DDP's buckets, which they are
    views of, are counted under "other")."""
    m = layout.micro_batches
    if layout.pp > 1:
        return layout.pp_schedule != "gpipe" and m > in_flight(layout, m)
    return m > 1


def reference_copy_bytes(w: Workload, layout: Layout, rank: int) -> int:
    """Full-weight DPO's reference: a frozen copy of the model laid out as the model is, its matrices
    in bf16 under bf16 training (counted under "other"; memory.json's params are the model's)."""
    if w.objective != "dpo" or w.peft is not None:
        return 0
    c = layout.coordinates(rank)
    params = stage_params(w.shape, layout, c["pp"])
    return sum(
        (2 if w.dtype != "fp32" and len(p.shape) >= 2 else 4) * local_numel(p, layout, c["tp"], c["dp_shard"])
        for p in params
    )


def estimate_memory(
    w: Workload, layout: Layout, runtime_gib: float = 0.0, fragmentation: float = 0.0, first_step: bool = False
) -> dict[str, float]:
    """What the busiest GPU holds: each item (params, grads, optimizer, activations, other) as
    the most any pipeline rank holds of it, and the largest peak of a rank (total): parameters and
    optimizer states always, plus either the activations with their working set (and the gradients,
    where they are resident) or, at the end of backward, all the gradients with the last recomputed
    block. Stages are uneven (the first holds the embedding, the last the output, and the layers
    may not divide), so the rank with the largest peak need not hold the most of every item.
    `first_step`: the peak of the first step, before AdamW has created its moments (a run's peak
    from the second step on is the default)."""
    ranks = [rank_memory(w, layout, pp_rank, runtime_gib, fragmentation, first_step) for pp_rank in range(layout.pp)]
    return {key: max(r[key] for r in ranks) for key in ranks[0]}


def rank_memory(
    w: Workload,
    layout: Layout,
    pp_rank: int,
    runtime_gib: float = 0.0,
    fragmentation: float = 0.0,
    first_step: bool = False,
) -> dict[str, float]:
    """The bytes of pipeline rank `pp_rank`'s largest shard (tp, dp coordinates 0), itemised, with
    its peak (see estimate_memory)."""
    rank = pp_rank * layout.dp * layout.tp
    states = model_state_bytes(w.shape, layout, rank, w.peft, w.dtype)
    act = activation_bytes(w, layout, pp_rank)
    buffers = other_bytes(w, layout, pp_rank, runtime_gib, fragmentation, act["saved"] + act["transient"])
    gathered = fsdp_gathered_bytes(w, layout, pp_rank)
    resident = resident_grad_bytes(w, layout, pp_rank, states["grads"])
    moments = 0 if first_step else states["optimizer"]
    saved, recompute = act["saved"], act["recompute"]
    working = max(
        saved + act["logits"] + gathered["loss"] + resident,  # the loss's backward
        saved - act["loss_freed"] + act["logits_grad"] + gathered["root"] + resident,  # ZeRO-3 regathers the root
        saved + recompute + gathered["blocks"] + resident,  # the blocks' backward (an upper bound)
        states["grads"] + recompute + gathered["blocks"],  # the end of backward
        act["reference"] + gathered["blocks"] + resident,  # DPO's reference forward, before the policy's
    )
    buffers += reference_copy_bytes(w, layout, rank)
    peak = states["params"] + moments + buffers + working
    other = buffers + max(
        act["logits"] + gathered["loss"], gathered["root"], recompute + gathered["blocks"], act["reference"]
    )
    if first_step:  # the step ends with parameters, gradients and the moments AdamW just made
        peak = max(peak, sum(states.values()))
    return {**states, "activations": act["saved"], "other": other, "total": peak}
