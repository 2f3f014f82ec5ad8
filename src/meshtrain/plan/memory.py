"""Bytes per GPU, item by item: model states (plan/states.py: exact, from the parameter table and the
sharding rules meshtrain applies; none on the GPU under CPU offload), activations (from the tensors
autograd saves, per block: plan/saved.py), pipeline in-flight micro-batches, logits and loss,
communication buffers (FSDP's gathered blocks, fp8 under FP8 tensorwise) and the allocator's slack.
"""

from __future__ import annotations

from meshtrain.layout import Layout
from meshtrain.plan.saved import (
    Precision,
    adapter_saved,
    compiled_llama_block,
    cp_saved,
    gpt_block,
    llama_block,
    op_block,
    per_token_bytes,
)
from meshtrain.plan.states import (
    STATE_BYTES,
    largest_target,
    local_numel,
    model_state_bytes,
    stage_params,
    stage_sums,
    trainable_sums,
)
from meshtrain.plan.workload import Workload

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
    cp = cp_saved(shape, layout, prec.attention)
    if w.compiled:  # inductor keeps the core's output and wo's input apart already: CP adds the key/value copies
        return per_token_bytes(compiled_llama_block(shape, prec) + lora + cp[1:], layout)
    return per_token_bytes(llama_block(shape, prec, w.device == "cuda", w.peft) + lora + cp, layout)


def checkpointed_block_bytes_per_token(w: Workload, layout: Layout) -> float:
    """A checkpointed block keeps only its input; under "op" also what op_block lists."""
    prec = Precision.of(w, layout.fsdp) if w.shape.arch == "llama" else None
    if layout.activation_checkpointing == "op":
        cp = cp_saved(w.shape, layout, prec.attention, op=True) if prec else []
        return per_token_bytes(op_block(w.shape, w, layout, prec) + cp, layout)
    stream = prec.stream if prec else (4 if w.dtype == "fp32" else 2)
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


def local_tokens(w: Workload, layout: Layout) -> int:
    """Tokens of a micro-batch one rank computes: its slice of S / cp of each sequence under context
    parallelism (embedding, norms, projections, MLP and loss; attention's internals over the whole
    sequence for heads / cp hold as much, cp_saved)."""
    return layout.micro_batch_size * (w.seq_len // layout.cp) * w.sequences


def all_to_all_bytes_per_token(w: Workload, layout: Layout) -> float:
    """Bytes of the tensors one layer's four all-to-alls move, per token of the rank's slice (before
    the (cp - 1) / cp that leaves the rank): q and the attention output (q_dim), k and v (their heads
    copied up to cp where fewer), on one TP rank, in the attention's dtype; 0 without CP."""
    if layout.cp == 1:
        return 0.0
    s = w.shape
    kv = max(s.n_kv_heads // layout.tp, layout.cp) * s.head_dim
    half = 4 if w.dtype == "fp32" or w.fp32_attention else 2
    return (2 * s.q_dim / layout.tp + 2 * kv) * half


def activation_bytes(w: Workload, layout: Layout, pp_rank: int = 0) -> dict[str, float]:
    """Bytes of saved activations on one rank at the peak of a step, and the transient working
    set on top of them (the logits' gradient; one checkpointed block recomputed in backward; DPO's
    no-grad reference forward: one block's working set and the logits with their fp32 log-softmax;
    under context parallelism the all-to-alls' buffers of one attention: the tensors sent and
    received, `all_to_all`)."""
    tokens = local_tokens(w, layout)
    layers = [n for stage in layout.stage_layers(w.shape.n_layers, pp_rank) for n in stage]
    full, ckpt = block_bytes_per_token(w, layout), checkpointed_block_bytes_per_token(w, layout)
    if layout.activation_checkpointing in ("full", "op"):
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
    # a recomputed block remakes its saved tensors, but for those "op" kept (handed over, not copied)
    recompute = (
        tokens * (max(0.0, full - ckpt) if layout.activation_checkpointing == "op" else full) if checkpointed else 0.0
    )
    logits = tokens * logits_working_bytes_per_token(w, layout) if last else 0.0
    all_to_all = tokens * all_to_all_bytes_per_token(w, layout)
    recompute += all_to_all  # in the blocks' backward: the gradients of q, k, v by heads and by sequence
    return {
        "saved": saved,
        "per_micro_batch": per_micro_batch,
        "recompute": recompute,  # with the all-to-alls' buffers
        "all_to_all": all_to_all,
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
    (CUDA context, NCCL) and the caching allocator's fragmentation, as a fraction of the activations.
    torchao's Float8Linear (training.fp8) calls no F.linear that autocast could cache a copy for: it
    casts its weight to fp8 in each pass, one linear at a time."""
    total = 0.0
    trainable = trainable_sums(w, layout, pp_rank)
    if w.dtype != "fp32" and not layout.fsdp and w.shape.arch == "llama":
        total += 2 * (trainable.linear - (trainable.block_linear if w.fp8 != "off" else 0))
    if ddp_buckets(layout):
        total += STATE_BYTES["grads"] * trainable.total
    if w.quantized:
        total += 2 * largest_target(w, layout, pp_rank)
    return total + runtime_gib * 2**30 + fragmentation * activations


def ddp_buckets(layout: Layout) -> bool:
    """Whether the trainer wraps the model in DDP: replicas (ZeRO-0/1, over DP x CP) without pipelining."""
    return layout.ddp


def gathered_bytes(w: Workload, layout: Layout, elements: float, block_linear: float) -> float:
    """Bytes FSDP all-gathers for `elements` parameters, `block_linear` of them the blocks' linear
    weights: the compute dtype's, and one byte for those under FP8 tensorwise with ZeRO-2/3 (torchao's
    float8 all-gather, parallel/float8.py: each rank casts its shard to fp8 before the gather, and
    Float8Linear computes with the gathered fp8 weight; the norms and the root group stay in the
    compute dtype)."""
    half = _half_bytes(w)
    fp8 = w.fp8 == "tensorwise" and layout.fsdp
    return elements * half - (block_linear * (half - 1) if fp8 else 0)


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
        stage = gathered_bytes(w, layout, total, sums.block_linear)
        return {"loss": stage, "root": 0.0, "blocks": stage + grads}
    block = gathered_bytes(w, layout, largest, sums.block_linear / max(1, len(sums.blocks)))
    return {"loss": block, "root": 2 * sums.outer * half + block, "blocks": sums.outer * half + 2 * block + grads}


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
        (2 if w.dtype != "fp32" and len(p.shape) >= 2 else 4) * local_numel(p, layout, c["tp"], c["shard"])
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
    its peak (see estimate_memory). Under CPU offload the GPU holds no model states (they are host
    memory, states.host_state_bytes): only the gathered blocks in flight (each shard copied to the
    GPU for its all-gather), one block's unsharded gradients before their reduce-scatter, the
    activations and the buffers."""
    rank = pp_rank * (layout.world // layout.pp)
    states = model_state_bytes(w.shape, layout, rank, w.peft, w.dtype)
    states = {k: 0 for k in states} if layout.cpu_offload else states
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
