"""What a block saves for backward, per token: the tensors autograd keeps in each precision path
(eager Llama, compiled Llama, GPT), LoRA's additions, and their bytes on one tensor-parallel rank. The
tables plan/memory.py builds the activation estimates from; tests/test_plan.py holds them to what
saved-tensor hooks measure."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.layout import Layout
from meshtrain.model.args import LoraSpec
from meshtrain.model.shapes import Shape
from meshtrain.plan.workload import Workload


@dataclass(frozen=True)
class Precision:
    """Bytes of the tensors a block saves, by the path the step takes (see parallel/precision.py):
    fp32; bf16 under autocast (the residual stream stays fp32, each linear casts and saves its own
    bf16 input); bf16 FSDP mixed precision (everything bf16, norms upcast to fp32 inside); and either
    bf16 path with fp32 arithmetic (attention on fp32 copies of q, k, v). LoRA under autocast saves
    as FSDP does: the frozen embedding is bf16, so is the residual stream, and each norm's output is
    bf16 already (no cast per linear). fp16 is bf16's paths in fp16, except under FSDP: autocast runs
    there too (fp16 needs its fp32 ops, train/step.py), and CUDA's autocast computes RMSNorm in fp32,
    so each norm saves an fp32 copy of its fp16 input and each linear casts the fp32 output itself
    (the CPU's autocast keeps RMSNorm in fp16). FP8 (torchao's Float8Linear) changes none of it: its
    autograd function saves the linear's high-precision input and weight and casts them to fp8 again
    in backward (torchao/float8/float8_linear.py, matmul_with_hp_or_float8_args)."""

    stream: int  # the residual stream between blocks (what a checkpointed block keeps)
    linear_input: int
    per_linear_copies: bool  # autocast: wq, wk, wv (w1, w3) each save their own cast of the norm output
    attention: int  # q, k, v and the attention output
    mlp: int  # the SwiGLU intermediates
    weight_copies: bool  # autocast caches a bf16 copy of every weight for the step
    upcast_norms: bool = False  # each norm saves an fp32 copy of its input (fp16 FSDP on CUDA)

    @classmethod
    def of(cls, w: Workload, fsdp: bool) -> "Precision":
        if w.dtype == "fp32":
            return cls(4, 4, False, 4, 4, False)
        attention = 4 if w.fp32_attention else 2
        if fsdp and w.dtype == "fp16" and w.peft is None:
            cuda = w.device == "cuda"
            return cls(2, 2, cuda, attention, 2, False, upcast_norms=cuda)
        if fsdp or w.peft is not None:  # LoRA's frozen bf16 embedding makes a bf16 residual stream
            return cls(2, 2, False, attention, 2, False)
        return cls(4, 2, True, attention, 2, True)


def llama_block(
    shape: Shape, prec: Precision, fused_norm: bool, peft: LoraSpec | None = None
) -> list[tuple[str, float, int, str]]:
    """The eager block. RMSNorm: CUDA's fused kernel saves its input and 1/rms; the CPU's composite
    one upcasts (the fp32 input) and also keeps the normalised input for the weight's gradient.
    A frozen base (`peft`) keeps less: a frozen linear's input gradient needs its weight, not its
    input, so a linear's input is kept only where an adapter's A needs it (autocast: each A its own
    cast of a norm's fp32 output; with dropout A keeps the dropped input instead, adapter_saved);
    SwiGLU's product only for an adapted w2; a frozen norm weight needs no normalised input."""
    h, q, kv, f, heads = shape.dim, shape.q_dim, shape.kv_dim, shape.ffn_dim, shape.n_heads
    normalised = not fused_norm and peft is None
    saved = []
    for norm, consumers in (("attention_norm", ("wq", "wk", "wv")), ("ffn_norm", ("w1", "w3"))):
        if peft is None:
            copies = len(consumers) if prec.per_linear_copies else 1
        else:
            adapted = 0 if peft.dropout > 0 else sum(c in peft.targets for c in consumers)
            copies = adapted if prec.per_linear_copies else min(1, adapted)
        saved += [
            (f"{norm} input", h, prec.stream if fused_norm and not prec.upcast_norms else 4, "sp"),
            (f"{norm} 1/rms", 1, 4, "sp"),
            *([(f"{norm} normalised input", h, 4, "sp")] if normalised else []),
            (f"{norm} output as the linears save it", h * copies, prec.linear_input, "full"),
        ]
    if shape.qk_norm:  # Qwen3: the same norm per head of q and k, its output cast for the rotation
        saved += [
            ("q/k norm inputs", q + kv, prec.stream if fused_norm and not prec.upcast_norms else 4, "tp"),
            ("q/k norm 1/rms", heads + shape.n_kv_heads, 4, "tp"),
            *([("q/k normalised inputs", q + kv, 4, "tp")] if normalised else []),
            ("q/k norm outputs", q + kv, prec.linear_input, "tp"),
        ]
    saved += [
        ("q, k after rotary; v", q + 2 * kv, prec.attention, "tp"),
        ("attention log-sum-exp", heads, 4, "tp"),
        ("attention output", q, prec.attention, "tp"),
    ]
    if prec.attention != prec.linear_input:  # fp32 arithmetic: wo saves its bf16 input besides the fp32 output
        saved.append(("wo input (bf16)", q, 2, "tp"))
    product = peft is None or ("w2" in peft.targets and peft.dropout == 0)
    saved.append(("SwiGLU: w1 out, w3 out, silu, product", (4 if product else 3) * f, prec.mlp, "tp"))
    return saved


def compiled_llama_block(shape: Shape, prec: Precision) -> list[tuple[str, float, int, str]]:
    """The block under torch.compile, as inductor's partitioner keeps it for backward (measured with
    saved-tensor hooks): the block's input, each norm's output cast once (not once per linear),
    q, k, v, the attention output and wo's contiguous copy of it, and three of SwiGLU's four
    intermediates (silu is recomputed); the residual sum and the normalised inputs are recomputed."""
    h, q, kv, f, heads = shape.dim, shape.q_dim, shape.kv_dim, shape.ffn_dim, shape.n_heads
    return [
        ("block input", h, prec.stream, "sp"),
        ("2 x 1/rms", 2, 4, "sp"),
        ("2 x norm output, cast once", 2 * h, prec.linear_input, "full"),
        ("q, k after rotary; v", q + 2 * kv, prec.attention, "tp"),
        ("attention log-sum-exp", heads, 4, "tp"),
        ("attention output and wo's input", 2 * q, prec.attention, "tp"),
        ("SwiGLU: w1 out, w3 out, product", 3 * f, prec.mlp, "tp"),
        *([("q/k before their norms, 1/rms", q + kv, prec.attention, "tp")] if shape.qk_norm else []),
    ]


def adapter_saved(shape: Shape, prec: Precision, peft: LoraSpec) -> list:
    """What LoRA adds to a block, per target linear and token: A's rank-sized output, which B keeps
    (compute dtype); with dropout, A's input is the dropped input (in-size, compute dtype) and
    dropout keeps its mask (a byte an element). Without dropout A's input is the linear's own
    input, counted by llama_block."""
    h, q, f = shape.dim, shape.q_dim, shape.ffn_dim
    inputs = {"wq": (h, "full"), "wk": (h, "full"), "wv": (h, "full"), "wo": (q, "tp"), "w1": (h, "full")}
    inputs |= {"w2": (f, "tp"), "w3": (h, "full")}
    saved = []
    for name in peft.targets:
        size, split = inputs[name]
        saved.append((f"{name} A output", peft.rank, prec.linear_input, "full"))
        if peft.dropout > 0:
            saved += [
                (f"{name} dropped input", size, prec.linear_input, split),
                (f"{name} dropout mask", size, 1, split),
            ]
    return saved


def gpt_block(shape: Shape, w: Workload) -> list[tuple[str, float, int, str]]:
    """Korthikanti et al. 2022, section 4.1: 34 s b h + 5 a s^2 b bytes per layer in 16-bit, with
    Megatron's sequence parallelism saving the sharded (not the gathered) linear inputs. Flash
    attention keeps the log-sum-exp instead of the s x s scores."""
    h, f, a, s = shape.dim, shape.ffn_dim, shape.n_heads, w.seq_len
    b = 4 if w.dtype == "fp32" else 2
    saved = [
        ("LayerNorm inputs", 2 * h, b, "sp"),
        ("QKV input", h, b, "sp"),
        ("Q, K", 2 * h, b, "tp"),
        ("V", h, b, "tp"),
        ("projection input", h, b, "tp"),
        ("dropout masks", 2 * h, 1, "sp"),
        ("fc1 input", h, b, "sp"),
        ("GELU input, fc2 input", 2 * f, b, "tp"),
    ]
    if w.attention == "math":
        saved += [
            ("softmax output", a * s, b, "tp"),
            ("attention dropout mask", a * s, 1, "tp"),
            ("attention dropout output", a * s, b, "tp"),
        ]
    else:
        saved.append(("attention log-sum-exp", a, 4, "tp"))
    return saved


def cp_saved(shape: Shape, layout: Layout, attention: int, op: bool = False) -> list[tuple[str, float, int, str]]:
    """What Ulysses attention (parallel/context_parallel.py) adds to a Llama block's saved tensors, per
    token of the rank's slice of S / cp (the attention core over the whole sequence for heads / cp
    saves as many elements as the slice for every head: q, k, v, its output and log-sum-exp are the
    block's own entries). The core's output, in the heads layout, is no longer the tensor wo saves:
    the all-to-all back makes wo's input (one more attention output). With fewer key/value heads per
    TP rank than cp, each is copied to cp of them before the all-to-all, and the core keeps the
    copies. Under op-level checkpointing ("op") the all-to-alls' outputs are kept as the TP
    collectives' are (SAVED_OPS): q, k, v gathered by heads and the output back by sequence. Elements
    are of the whole model, split over TP ("tp"), as the other tables give them."""
    if layout.cp == 1:
        return []
    q, kv_local = shape.q_dim, shape.n_kv_heads // layout.tp
    kv = max(kv_local, layout.cp) * shape.head_dim * layout.tp  # key/value elements the all-to-all moves
    if op:
        return [("all-to-all outputs: q, k, v by heads, attention output by sequence", 2 * q + 2 * kv, attention, "tp")]
    saved = [("attention output by sequence (wo's input, after the all-to-all)", q, attention, "tp")]
    if kv > shape.kv_dim:
        saved.append(("k, v heads copied for the all-to-all", 2 * (kv - shape.kv_dim), attention, "tp"))
    return saved


def per_token_bytes(saved, layout: Layout) -> float:
    t, sp = layout.tp, layout.sequence_parallel

    def divisor(split):
        return t if split == "tp" or (split == "sp" and sp) else 1

    return sum(n * b / divisor(split) for _, n, b, split in saved)


def op_block(shape: Shape, w: Workload, layout: Layout, prec: Precision | None) -> list[tuple[str, float, int, str]]:
    """A block under op-level checkpointing ("op", parallel/activation_checkpoint.py): its input (what
    the checkpoint holds) and the outputs of its matmuls, attention kernel and tensor-parallel
    collectives, whatever they feed; norms, rotary, SwiGLU's pointwise ops and casts are recomputed.
    A row-parallel matmul's output (wo, w2) is a partial sum of whole rows until its collective, whose
    output is kept too: reduce-scattered under sequence parallelism, which all-gathers each norm's
    output (the stream's dtype) for the column-parallel matmuls; all-reduced without it. LoRA adds
    its adapters' A and B outputs. With fp32 arithmetic the matmuls' outputs are fp32 (cast to bf16
    after, parallel/precision.py). `prec`: None for GPT (16-bit or fp32 throughout)."""
    h, q, kv, f, heads = shape.dim, shape.q_dim, shape.kv_dim, shape.ffn_dim, shape.n_heads
    half = 4 if w.dtype == "fp32" else 2
    stream, out, attention = (prec.stream, prec.linear_input, prec.attention) if prec else (half, half, half)
    out = 4 if w.fp32_arithmetic else out
    mlp_in = 2 * f if shape.arch == "llama" else f
    saved = [
        ("block input", h, stream, "sp"),
        ("q, k, v projections", q + 2 * kv, out, "tp"),
        ("attention output", q, attention, "tp"),
        ("attention log-sum-exp", heads, 4, "tp"),
        ("wo, w2 outputs (partial sums under TP)", 2 * h, out, "full"),
        ("MLP up projections", mlp_in, out, "tp"),
    ]
    if layout.tp > 1 and layout.sequence_parallel:
        saved += [("all-gathered norm outputs", 2 * h, stream, "full"), ("reduce-scattered outputs", 2 * h, out, "sp")]
    elif layout.tp > 1:
        saved.append(("all-reduced outputs", 2 * h, out, "full"))
    if w.peft is not None:
        outs = {"wq": q, "wk": kv, "wv": kv, "wo": h, "w1": f, "w2": h, "w3": f}
        for name in w.peft.targets:
            split = "full" if name in ("wo", "w2") else "tp"
            saved += [(f"{name} A output", w.peft.rank, out, "full"), (f"{name} B output", outs[name], out, split)]
    return saved
