"""Step time of a layout: matmuls at a sustained fraction of the device's peak, memory-bound work at
its memory bandwidth, tensor-parallel collectives inside each block, the pipeline's bubble and
point-to-point sends, data-parallel gradient (and ZeRO-3 parameter) traffic with what overlaps
with compute, and the optimizer step.

Sources: FLOPs per token, PaLM (Chowdhery et al. 2022) appendix B; TP volume and the bubble
(p - 1) / (v m), Narayanan et al. 2021; ring collectives 2 (n - 1) / n, nccl-tests' bus bandwidth;
DP traffic 2 psi (DDP, ZeRO-1/2) and 3 psi (ZeRO-3), Rajbhandari et al. 2020. FP8 GEMMs and CPU
offload: see FP8_GEMM_SHARE and HOST_ADAM_GBS."""

from __future__ import annotations

from meshtrain.layout import Layout
from meshtrain.plan.hardware import Device
from meshtrain.plan.memory import (
    all_to_all_bytes_per_token,
    block_bytes_per_token,
    ends_bytes_per_token,
    gathered_bytes,
    local_tokens,
    logits_working_bytes_per_token,
)
from meshtrain.plan.states import STATE_BYTES, model_state_bytes, stage_sums, target_elements, trainable_sums
from meshtrain.plan.workload import Workload


def _bandwidth(group_span: int, dev: Device, inter_gbps: float) -> float:
    """GB/s a collective over ranks `group_span` apart end to end sees: NVLink inside a node, the
    network once the group leaves it."""
    return dev.intra_node_gbps if group_span <= dev.gpus_per_node else inter_gbps


MEMORY_PASSES = 6

# The share of the FP8 dense peak torchao's scaled GEMMs sustain relative to a bf16 GEMM's share of
# the bf16 peak, their dynamic-scaling casts (amax and cast of input, weight and output gradient in
# each pass) included. Fitted so that the planner gives the end-to-end speed-ups torchtitan published
# for Llama 3 8B on 8 H100s (FSDP, torch.compile): tensorwise 6,667 -> 8,532 tokens/s per GPU, 1.28x
# (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 1: Llama 3.1 8B, local batch 2,
# selective checkpointing); rowwise 5,760 -> 6,424, 1.115x (torchtitan commit 7a04053, the same
# model and GPUs, where tensorwise gave 1.248x).
FP8_GEMM_SHARE = {"tensorwise": 0.87, "rowwise": 0.63}


def gemm_efficiency(dev: Device, width: int) -> float:
    """The sustained share of the peak a matmul whose narrowest dimension (hidden size per TP rank)
    is `width` reaches: large GEMMs `matmul_efficiency`, smaller ones less (tiles and waves left
    part-empty, the same fixed costs over less work), as width / (width + gemm_half_width)."""
    return dev.matmul_efficiency * width / (width + dev.gemm_half_width)


def attention_efficiency(dev: Device, head_dim: int) -> float:
    """Flash attention's share of the peak, `attention_efficiency` at head dimension 128: each tile
    of scores costs the same softmax and bookkeeping whatever its depth, so a head of 64 gets 3/4 of
    it (FlashAttention-2, Dao 2023, figures 5-7: 64 versus 128 on A100 and H100)."""
    return dev.attention_efficiency * head_dim / (head_dim + 64) * (128 + 64) / 128


def memory_traffic_per_token(w: Workload, layout: Layout, pp_rank: int, layers: int, recomputed: int) -> float:
    """Bytes the memory-bound kernels (norms, rotary, SwiGLU, softmax, casts, the loss) move per token
    of a micro-batch: MEMORY_PASSES over every tensor a block keeps (written and read in forward, read
    again in backward, its gradient written and read, and the temporaries around them; fitted, see
    docs/planning.md), one more for a recomputed block; on the last stage as many over what the loss
    keeps and its working set (eager: fp32 copies; compiled: one fused kernel)."""
    block = block_bytes_per_token(w, layout)
    total = (MEMORY_PASSES * layers + recomputed) * block
    if layout.holds_last_stage(pp_rank):
        loss = ends_bytes_per_token(w, layout, False, True) + logits_working_bytes_per_token(w, layout)
        total += MEMORY_PASSES * loss
    return total


def micro_batch_time(w: Workload, layout: Layout, dev: Device, inter_gbps: float, pp_rank: int) -> dict[str, float]:
    """One micro-batch's forward + backward on one pipeline rank: matmuls at their shape's efficiency
    and attention at the device's attention efficiency (recomputation included), memory-bound work,
    TP collectives, CP's all-to-alls and the sends to the neighbouring stages.

    Under context parallelism a rank computes S / cp tokens of each sequence: the matmuls and the
    memory-bound work of its slice (1 / cp of the sequence's), and attention over the whole sequence
    for heads / cp, which is the same 12 q_dim S FLOPs per token of its slice (1 / cp of the
    sequence's; causal: every rank holds every query position, so none waits on another). Causal or
    document-masked, attention is counted as the dense product, as PaLM's and the training log's MFU
    count it (see docs/planning.md: document masking's cost)."""
    shape, t, s, h = w.shape, layout.tp, w.seq_len, w.shape.dim
    gemm_dtype = "fp32" if w.dtype == "fp32" or w.fp32_arithmetic else w.dtype
    attention_dtype = "fp32" if w.dtype == "fp32" or w.fp32_attention else w.dtype
    act_bytes = 4 if w.dtype == "fp32" else 2
    tokens = local_tokens(w, layout)
    layers = [n for stage in layout.stage_layers(shape.n_layers, pp_rank) for n in stage]
    block = stage_sums(shape, layout, pp_rank).block_full
    head = shape.vocab_size * h if layout.holds_last_stage(pp_rank) else 0
    attention = 12 * shape.q_dim * s  # scores and weighted sum, forward + backward
    recomputed = {"full": len(layers), "selective": len(layers[:: layout.ac_every])}
    recomputed = recomputed.get(layout.activation_checkpointing, 0)
    # "op" keeps the matmul, attention and collective outputs: its blocks rerun only the memory-bound ops
    memory_recomputed = len(layers) if layout.activation_checkpointing == "op" else recomputed
    # A frozen base (LoRA) computes no weight gradients: forward and input gradient, 4 of the 6; its
    # adapters train whole. DPO's reference forward adds one more forward (2 and a third of attention).
    frozen = w.peft is not None
    adapter = trainable_sums(w, layout, pp_rank).block_full if frozen else 0
    reference = 1 if w.objective == "dpo" else 0
    # training.fp8: the blocks' linears (not the output layer, training.fp8 excludes adapters) in FP8
    fp8 = tokens * block * (6 * len(layers) + 2 * recomputed + 2 * reference * len(layers)) if w.fp8 != "off" else 0
    gemm = -fp8 + tokens * (
        (4 if frozen else 6) * (len(layers) * block + head)
        + 6 * len(layers) * adapter
        + 2 * recomputed * (block + adapter)
        + 2 * reference * (len(layers) * block + head)
    )
    attend = tokens * attention * (len(layers) + (recomputed + reference * len(layers)) / 3)
    compute = (
        gemm / gemm_efficiency(dev, h // t) / dev.peak(gemm_dtype)
        + (fp8 / (gemm_efficiency(dev, h // t) * FP8_GEMM_SHARE[w.fp8]) / dev.peak("fp8") if fp8 else 0.0)
        + attend / attention_efficiency(dev, shape.head_dim) / dev.peak(attention_dtype)
    ) / (t * 1e12)
    traffic = tokens * memory_traffic_per_token(w, layout, pp_rank, len(layers), memory_recomputed)
    if w.quantized:  # QLoRA dequantizes each target weight in every pass over it: NF4 read, bf16 written and read
        targets = target_elements(w, layout, pp_rank)
        traffic += (2 + memory_recomputed / max(1, len(layers)) + reference) * targets * (0.52 + 4)
    memory_bound = traffic / (dev.memory_gbs * 1e9)
    tp_comm = 0.0
    if t > 1:  # 4 all-reduces (or reduce-scatter + all-gather pairs) per block and pass: 8 b s h (t-1)/t
        passes = len(layers) + recomputed / 2
        tp_comm = 8 * tokens * h * act_bytes * (t - 1) / t * passes / (_bandwidth(t, dev, inter_gbps) * 1e9)
    cp_comm = 0.0
    if layout.cp > 1:
        # Ulysses: q, k, v in and the output back, an all-to-all each, per block and pass (forward,
        # backward, and a recomputed block's forward again; "op" keeps their outputs), each sending
        # (cp - 1) / cp of the rank's tensor to ranks tp apart inside the cp x tp group. They sit on
        # the critical path: attention waits for its q, k, v and wo for its input, so nothing overlaps
        # them with compute (unlike the DP traffic below).
        passes = 2 * len(layers) + recomputed  # "op" recomputes no block's all-to-alls (recomputed is 0)
        ring = (layout.cp - 1) / layout.cp
        moved = tokens * all_to_all_bytes_per_token(w, layout) * ring * passes
        cp_comm = moved / (_bandwidth(layout.cp * t, dev, inter_gbps) * 1e9)
    p2p = 0.0
    if layout.pp > 1:  # activations forward, their gradients backward, to the next stage dp x cp x tp ranks away
        span = layout.dp * layout.cp * t * 2
        p2p = 2 * tokens * h * act_bytes / t / (_bandwidth(span, dev, inter_gbps) * 1e9)
    return {
        "compute": compute,
        "memory_bound": memory_bound,
        "tp_comm": tp_comm,
        "cp_comm": cp_comm,
        "p2p": p2p,
        "total": compute + memory_bound + tp_comm + cp_comm + p2p,
    }


def model_flops_per_token(w: Workload) -> float:
    """Model FLOPs of training one token (Shape.flops_per_token: 6 x the matmul parameters plus
    attention; a frozen base (LoRA) 4 for its weights and 6 for its adapters; DPO's reference
    forward 2 more and a third of the attention), as the training log's MFU counts them."""
    return w.shape.flops_per_token(w.seq_len, w.peft, w.objective == "dpo")


def step_time(w: Workload, layout: Layout, dev: Device, inter_gbps: float) -> dict[str, float]:
    """Seconds per optimizer step and what they buy: tokens/s, model TFLOP/s per GPU and MFU."""
    p, dp, t = layout.pp, layout.dp_cp, layout.tp  # gradients average over DP x CP
    m = layout.micro_batches
    per_rank = [micro_batch_time(w, layout, dev, inter_gbps, r) for r in sorted({0, p - 1})]
    slowest = max(per_rank, key=lambda x: x["total"])
    bubble = (p - 1) / layout.stages_per_rank * slowest["total"]
    if layout.pp_schedule in ("zero_bubble", "zbv") and p > 1:
        bubble /= 3  # splitting backward into input and weight gradients fills most of the bubble
    pipeline = m * slowest["total"] + bubble

    local = trainable_sums(w, layout, 0).total  # what has gradients to reduce and moments to update
    stage = stage_sums(w.shape, layout, 0)
    gathered = gathered_bytes(w, layout, stage.total + (local if w.peft is not None else 0), stage.block_linear)
    dp_comm = 0.0
    if dp > 1:  # gradients, psi bytes in fp32, averaged over DP x CP; FSDP shards over dp_shard x cp
        psi = local * STATE_BYTES["grads"]
        shards = layout.shard_ranks
        if layout.fsdp:  # reduce-scatter the gradients, all-gather the parameters (twice for ZeRO-3)
            ring = (shards - 1) / shards
            gathers = 2 if layout.zero == 3 else 1
            dp_comm = ring * (psi + gathers * gathered) / (_bandwidth(shards * t, dev, inter_gbps) * 1e9)
            if layout.dp_replicate > 1:
                r = layout.dp_replicate
                dp_comm += 2 * (r - 1) / r * psi / shards / (inter_gbps * 1e9)
        else:
            dp_comm = 2 * (dp - 1) / dp * psi / (_bandwidth(dp * t, dev, inter_gbps) * 1e9)
    # On a GPU, NCCL runs beside the kernels: gradient traffic hides behind the last micro-batch's
    # backward (ZeRO-3's gathers behind its forward). On a CPU, gloo competes for the same cores.
    overlap = 0.0 if dev.name == "cpu" else slowest["compute"]
    exposed = max(0.0, dp_comm - overlap)
    # Fused AdamW reads parameter, gradient and two moments and writes parameter and moments (fp32).
    moments = local / (layout.shard_ranks if layout.fsdp else dp if layout.zero == 1 else 1)
    optimizer = moments * 28 / (dev.memory_gbs * 1e9)
    pcie = 0.0
    if layout.cpu_offload:
        pcie, optimizer = offload_times(w, layout, dev)

    step = pipeline + exposed + optimizer + pcie
    tokens_per_s = layout.global_batch_size * w.sequences * w.seq_len / step / layout.world
    tflops = tokens_per_s * model_flops_per_token(w) / 1e12
    return {
        "step_time_s": step,
        "tokens_per_s_per_gpu": tokens_per_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / mfu_peak(w, dev),
        "seconds": {
            "compute": m * slowest["compute"],
            "memory_bound": m * slowest["memory_bound"],
            "tp_comm": m * slowest["tp_comm"],
            "cp_comm": m * slowest["cp_comm"],
            "pp_p2p": m * slowest["p2p"],
            "pp_bubble": bubble,
            "dp_comm_exposed": exposed,
            "optimizer": optimizer,
            "pcie": pcie,
        },
    }


def mfu_peak(w: Workload, dev: Device) -> float:
    """What MFU divides by, as `train` divides it (hardware.mfu_peak_tflops): the dense peak of the
    training's arithmetic, with training.fp8 the larger of it and the FP8 peak."""
    peak = dev.peak("fp32" if w.dtype == "fp32" else w.dtype)
    return max(peak, dev.peak("fp8")) if w.fp8 != "off" else peak


# AdamW on the host under CPU offload, GB/s of host memory traffic one rank's optimizer step moves: a
# conservative figure for torch's CPU AdamW on a rank's share of the cores, where a two-socket node's
# 200-400 GB/s of DRAM bandwidth is shared by its 8 ranks and the kernel stays well below stream rates.
HOST_ADAM_GBS = 20.0


def offload_times(w: Workload, layout: Layout, dev: Device) -> tuple[float, float]:
    """(PCIe seconds, optimizer seconds) of a step under CPU offload (FSDP2's CPUOffloadPolicy). Each
    all-gather first copies the rank's fp32 shard to the GPU: ZeRO-3 gathers every group in forward
    and again in backward, in each micro-batch; the sharded fp32 gradients go back once a step, after
    the reduce-scatter. The copies are synchronous (the host's shard must be on the GPU before the
    all-gather's copy-in, and the gradients on the host before the CPU optimizer steps): not
    overlapped with compute. AdamW then steps on the host: the same 28 bytes per parameter as on the
    GPU (parameter, gradient and two moments read, three written) at HOST_ADAM_GBS."""
    states = model_state_bytes(w.shape, layout, 0, w.peft, w.dtype)
    copied = 2 * layout.micro_batches * states["params"] + states["grads"]
    moments = states["optimizer"] / STATE_BYTES["optimizer"]
    return copied / (dev.pcie_gbs * 1e9), moments * 28 / (HOST_ADAM_GBS * 1e9)
