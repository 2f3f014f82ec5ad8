"""Runs the planner is held to: meshtrain's own steps measured on an H100, and published large runs.
Each reference re-plans its run (the same model, GPUs, degrees and batch; the knobs the paper does
not give are searched) and sets the prediction beside what was measured. tests/test_plan.py holds
the errors to their bounds; `python -m bench planner` prints the table in bench/README.md."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.layout import Layout
from meshtrain.model.llama import ModelArgs
from meshtrain.model.presets import PRESETS
from meshtrain.model.shapes import Shape
from meshtrain.plan.hardware import device
from meshtrain.plan.memory import estimate_memory
from meshtrain.plan.search import search
from meshtrain.plan.speed import step_time
from meshtrain.plan.workload import Workload

MIB = 2**20
LLAMA_1B = ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, vocab_size=32000, max_seq_len=2048)


@dataclass(frozen=True)
class H100Step:
    """`meshtrain train` on one H100 80GB SXM (torch 2.11.0+cu130, bf16 autocast over fp32 weights,
    fused AdamW, SDPA; per-block compile with a compiled loss). Peak: max_memory_allocated after the
    first step (memory.json then; AdamW's moments did not exist yet). tok/s: median after step 1."""

    model: str
    seq_len: int
    micro_batch: int
    compiled: bool
    peak_mib: float
    tokens_per_s: float


H100_STEPS = (
    H100Step("gpt2-124m", 1024, 8, False, 8919, 174.1e3),
    H100Step("gpt2-124m", 1024, 16, False, 17080, 216.5e3),
    H100Step("gpt2-124m", 1024, 32, False, 33408, 235.3e3),
    H100Step("gpt2-124m", 1024, 16, True, 8876, 342.6e3),
    H100Step("1.1b", 2048, 4, False, 24986, 47.0e3),
    H100Step("1.1b", 2048, 8, False, 43770, 50.5e3),
    H100Step("1.1b", 2048, 8, True, 30266, 69.9e3),
)


def h100_step(row: H100Step) -> dict:
    """The planner's first-step peak (CUDA allocator bytes: no context, no fragmentation) and tokens/s."""
    args = LLAMA_1B if row.model == "1.1b" else PRESETS[row.model]
    w = Workload(Shape.from_args(args), row.seq_len, "bf16", device="cuda", compiled=row.compiled)
    layout = Layout(global_batch_size=row.micro_batch, micro_batch_size=row.micro_batch)
    dev, inter = device("h100-80gb", 1)
    peak = estimate_memory(w, layout, first_step=True)["total"] / MIB
    tokens = step_time(w, layout, dev, inter)["tokens_per_s_per_gpu"]
    return {"peak_mib": peak, "tokens_per_s": tokens}


@dataclass(frozen=True)
class PublishedRun:
    """A published run: its model, GPUs, degrees and batch, and the TFLOP/s per GPU it reports."""

    name: str
    shape: Shape
    gpu: str
    gpus: int
    tp: int
    pp: int
    global_batch: int
    seq_len: int
    tflops_per_gpu: float
    source: str


def _megatron_gpt(params_b: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tflops):
    return PublishedRun(
        f"GPT {params_b}B",
        Shape.gpt(hidden, layers, heads, 51200, 2048),
        "a100-80gb",
        gpus,
        tp,
        pp,
        batch,
        2048,
        tflops,
        "Narayanan et al. 2021, table 1",
    )


# Megatron-LM's weak-scaling runs on Selene (DGX A100 80GB, 8 x 200 Gb/s HDR per node): fp16,
# full activation recomputation, interleaved 1F1B, no sequence parallelism or flash attention.
MEGATRON_2021 = (
    _megatron_gpt("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron_gpt("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron_gpt("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron_gpt("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron_gpt("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron_gpt("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron_gpt("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron_gpt("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron_gpt("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron_gpt("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

# Llama 3 405B pre-training (Dubey et al. 2024, table 4): H100s, TP 8, PP 16, seq 8192, 16M tokens
# per batch; the 8,192-GPU run at DP 64, the 16,384-GPU one at DP 128.
LLAMA3_405B = tuple(
    PublishedRun(
        f"Llama 3 405B on {gpus}",
        Shape.from_args(PRESETS["llama3-405b"]),
        "h100-80gb",
        gpus,
        8,
        16,
        2048,
        8192,
        tflops,
        "Dubey et al. 2024, table 4",
    )
    for gpus, tflops in ((8192, 430), (16384, 400))
)


def megatron_flops_per_token(shape: Shape, seq_len: int) -> float:
    """Narayanan et al. 2021's count (their eq. 3, per token): 96 l h^2 (1 + s / 6h + V / 16 l h),
    which counts the recomputed forward: their TFLOP/s are hardware FLOPs with full recomputation."""
    layers, h = shape.n_layers, shape.dim
    return 96 * layers * h * h * (1 + seq_len / (6 * h) + shape.vocab_size / (16 * layers * h))


def plan_published(run: PublishedRun) -> dict:
    """The best layout that fits at the run's degrees, and its TFLOP/s per GPU counted as the paper
    counts them."""
    megatron = run.shape.arch == "gpt"
    w = Workload(run.shape, run.seq_len, "bf16", attention="math" if megatron else "flash")
    dev, inter = device(run.gpu)
    fixed = {"tp": run.tp, "pp": run.pp, "dp_replicate": 1}
    if megatron:  # what the paper ran: plain data parallelism, full recomputation, interleaved when pipelined
        fixed |= {"zero": 0, "activation_checkpointing": "full", "sequence_parallel": False}
        fixed |= {"pp_schedule": "interleaved_1f1b"} if run.pp > 1 else {}
    estimates, _ = search(w, dev, inter, run.gpus, run.global_batch, fixed)
    best = next(e for e in estimates if e.fits)
    tflops = best.speed["tflops_per_gpu"]
    if megatron:
        tflops = best.speed["tokens_per_s_per_gpu"] * megatron_flops_per_token(run.shape, run.seq_len) / 1e12
    return {"layout": best.layout, "tflops_per_gpu": tflops}
