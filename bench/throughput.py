"""Single-process training throughput: meshtrain against Hugging Face `LlamaForCausalLM` of the same
shape, trained with a plain PyTorch loop (same AdamW hyperparameters, batch, sequence length,
thread count, SDPA attention, autocast), timed in interleaved rounds in one process so machine
noise hits every variant alike. A row is one dtype:
  fp32, bf16        meshtrain's training.dtype; the HF loop in fp32 or under bf16 autocast
  fp16              training.dtype = "fp16" (autocast fp16, fp32 master weights, the trainer's dynamic
                    loss scale); the HF loop in the AMP recipe: autocast float16 and a GradScaler
  fp8-tensorwise, fp8-rowwise
                    training.fp8 in bf16 training with bf16 kernels around the FP8 GEMMs (torchao's
                    Float8Linear; emulated on a CPU: same numbers, no speed-up); the HF baseline is
                    the bf16 loop, what a user without torchao trains in

A ratio is the median over rounds of the ratio within a round (the host's speed drifts between
rounds, far less within one), reported with its range over rounds. MFU is against the matmul peak
measured in the same run.

Variants:
  meshtrain           meshtrain's own step (`parallelize` + `train_step`: fused AdamW, clipping)
  meshtrain+compile   the same with training.compile = true (one process: the whole model and the loss compiled)
  meshtrain+compile/bf16-kernels
                      bf16 rows only: training.bf16_compute = "bf16", i.e. bf16 kernels whatever
                      "auto" measured (= the first two where "auto" picks them)
  hf                  the plain loop: torch.optim.AdamW with its defaults, clip_grad_norm_
  hf+fused            the plain loop with fused AdamW: isolates the model code from the optimizer
  hf+compile          the strongest peer: the whole HF model under torch.compile, fused AdamW
  meshtrain+compile+cudagraphs, hf+compile+cudagraphs
                      on a GPU: training.cuda_graphs, and the HF model under torch.compile's
                      mode="reduce-overhead" (the same CUDA graphs): a small model's step waits on
                      the host's kernel launches, which the graphs replace with one launch each

Each row also compares meshtrain's best variant with the best HF variant. MFU is against the best
dense peak the device has for the row's dtype (bf16 or fp16 on a CPU: the larger of its bf16 or
fp16 and fp32 matmul peaks; fp8 rows: bf16's), whatever arithmetic a variant ran. Where bf16
kernels are emulated (a CPU without bf16 instructions, bf16 work many times slower than fp32), the
variants that would run them (the HF loops under autocast, bf16-kernels) are skipped in bf16 rows
and the row says so: one of their steps would take minutes. fp16 kernels are judged the same way,
by the measured fp16 and fp32 matmul peaks (the "auto" probe has no fp16 candidate): an fp16 row
runs fp16 kernels in every variant, so it is skipped whole. An fp8 row on a GPU without FP8 units
is skipped with meshtrain's refusal.

After the timed rounds each variant's last loss (and fp16's loss scale) is kept in the row: the
timed steps trained, and no fp16 step was skipped for an overflow while the scale stayed at its
start.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.common import device, markdown, timed, write_results
from meshtrain.config import load_config
from meshtrain.data.windows import IGNORE_INDEX
from meshtrain.hardware import cpu_peak_tflops, device_peak_tflops, mfu_peak_tflops
from meshtrain.interop.families import args_to_config
from meshtrain.job.arithmetic import resolve
from meshtrain.job.device import fp8_refusal
from meshtrain.job.model import model_args
from meshtrain.model.shapes import Shape
from meshtrain.parallel.precision import arithmetic_label
from meshtrain.train.build import build

NATIVE = "meshtrain+compile/bf16-kernels"
GRAPHS = "meshtrain+compile+cudagraphs"
HF_GRAPHS = "hf+compile+cudagraphs"
MESHTRAIN = ("meshtrain", "meshtrain+compile", NATIVE, GRAPHS)
HF = ("hf", "hf+fused", "hf+compile", HF_GRAPHS)
VARIANTS = (*MESHTRAIN, *HF)
EMULATED_BF16 = 4.0  # bf16 (or fp16) kernels this many times slower than fp32 arithmetic: not run in the bench
FP8 = ("fp8-tensorwise", "fp8-rowwise")
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_LOOP = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast + GradScaler"}


def training_dtype(dtype: str) -> str:
    """A row's training.dtype, which is also its HF loop's: fp8 rows train in bf16 around their FP8
    GEMMs (torchao's recipe), and bf16 is what a HF user without torchao trains in."""
    return "bf16" if dtype in FP8 else dtype


def fp8_recipe(dtype: str) -> str:
    """A row's training.fp8."""
    return dtype.removeprefix("fp8-") if dtype in FP8 else "off"


def hf_loop(dtype: str) -> str:
    return HF_LOOP[training_dtype(dtype)] + (" (no torchao)" if dtype in FP8 else "")


def bf16_kernel_slowdown(dtype: str, dev: torch.device, preset: str = "tiny") -> float:
    """How many times slower all-bf16 kernels are than fp32 arithmetic on bf16 storage here, as
    training.bf16_compute = "auto" measured it for the preset (1 outside bf16 on a CPU)."""
    if dtype != "bf16" or dev.type != "cpu":
        return 1.0
    cfg = load_config(overrides={"model.preset": preset, "training.dtype": "bf16"})
    step_ms = resolve(cfg, model_args(cfg), dev)[1].step_ms
    return step_ms["bf16"] / step_ms["bf16/fp32"]


def kernel_slowdown(dtype: str, dev: torch.device, preset: str) -> float:
    """How many times slower than fp32 arithmetic the low-precision kernels of a row are here: bf16
    (also around fp8's GEMMs) as bf16_compute = "auto" measured it, fp16 as the matmul peaks do."""
    if dtype == "fp16" and dev.type == "cpu":
        return cpu_peak_tflops(torch.float32) / cpu_peak_tflops(torch.float16)
    return bf16_kernel_slowdown(training_dtype(dtype), dev, preset)


def meshtrain_config(preset: str, dtype: str, compile: bool, bf16_compute: str, batch: tuple, graphs: bool = False):
    inputs, _ = batch
    return load_config(
        overrides={
            "model.preset": preset,
            "training.dtype": training_dtype(dtype),
            "training.fp8": fp8_recipe(dtype),
            "training.compile": compile,
            "training.cuda_graphs": graphs,
            "training.bf16_compute": bf16_compute,
            "training.seq_len": inputs.shape[1],
            "training.global_batch_size": len(inputs),
            "training.micro_batch_size": len(inputs),
            "training.lr": 3e-4,
        }
    )


class MeshtrainStep:
    """meshtrain's step as the trainer runs it, on a fixed batch: TrainState.step (parallelize() +
    train_step), with fp16's LossScaler built by TrainState as for `meshtrain train`."""

    def __init__(self, cfg, batch: tuple):
        self.state = build(cfg, with_data=False)
        self.batch = batch
        # counted once, as the trainer's loader counts each batch on the host: the step itself never
        # waits for the device (counting the targets there would, and stall a GPU's queue every step)
        self.n_targets = int((batch[1] != IGNORE_INDEX).sum())
        self.loss = None  # the last step's, a tensor: timing never waits on it

    def __call__(self):
        self.loss = self.state.step(*self.batch, self.n_targets)[0]

    def loss_scale(self) -> float | None:
        return None if self.state.scaler is None else float(self.state.scaler.factor())


class HFStep:
    """What a user writes around transformers: forward, loss, backward, clip, AdamW (optionally the
    whole model under torch.compile). In fp16 the AMP recipe: autocast float16 and a GradScaler that
    scales the loss, unscales the gradients before clipping, skips a step whose gradients overflowed
    and adjusts the scale (disabled, the same calls are the plain loop)."""

    def __init__(
        self,
        args,
        dtype: str,
        fused: bool,
        batch: tuple,
        dev: torch.device,
        compiled: bool = False,
        graphs: bool = False,
    ):
        from transformers import LlamaConfig, LlamaForCausalLM

        exported = args_to_config(args, "float32", None, [])
        config = LlamaConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "model_type")})
        config._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(config).to(dev)
        mode = "reduce-overhead" if graphs else None
        self.forward = torch.compile(self.model, mode=mode) if compiled else self.model
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True if fused else None
        )
        self.autocast = AUTOCAST[dtype]
        self.scaler = torch.amp.GradScaler(dev.type, enabled=dtype == "fp16")
        self.dev, self.batch = dev, batch
        self.loss = None

    def __call__(self):
        inputs, targets = self.batch
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.dev.type, dtype=self.autocast, enabled=self.autocast is not None):
            logits = self.forward(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.scaler.scale(loss).backward()
        self.loss = loss.detach()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler.is_enabled() else None


def run(preset: str, dtype: str, batch_size: int, seq_len: int, steps: int, rounds: int) -> dict:
    dev = device()
    args = model_args(load_config(overrides={"model.preset": preset}))
    tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
    arithmetic = "bf16" if dtype in FP8 else "auto"
    configs = {
        "meshtrain": meshtrain_config(preset, dtype, False, arithmetic, batch),
        "meshtrain+compile": meshtrain_config(preset, dtype, True, arithmetic, batch),
    }
    slowdown = kernel_slowdown(dtype, dev, preset)
    skipped = ""
    if slowdown >= EMULATED_BF16:
        skipped = (
            f"{'fp16' if dtype == 'fp16' else 'bf16'} kernels are {slowdown:.0f}x slower than fp32 arithmetic on this "
            "CPU (emulated): the variants that run them were not run"
        )
    elif dtype in FP8:
        skipped = fp8_refusal(dtype.removeprefix("fp8-"), dev)
    if dtype == "bf16" and not skipped:
        configs[NATIVE] = meshtrain_config(preset, dtype, True, "bf16", batch)
    if dev.type == "cuda" and not skipped:
        configs[GRAPHS] = meshtrain_config(preset, dtype, True, arithmetic, batch, graphs=True)
    # a skipped bf16 row still runs meshtrain's "auto" variants (they pick fp32 arithmetic); a skipped
    # fp16 or fp8 row has no variant without the skipped kernels
    fns = {name: MeshtrainStep(cfg, batch) for name, cfg in configs.items() if dtype == "bf16" or not skipped}
    if not skipped:
        fns["hf"] = HFStep(args, training_dtype(dtype), False, batch, dev)
        fns["hf+fused"] = HFStep(args, training_dtype(dtype), True, batch, dev)
        fns["hf+compile"] = HFStep(args, training_dtype(dtype), True, batch, dev, compiled=True)
        if dev.type == "cuda":
            fns[HF_GRAPHS] = HFStep(args, training_dtype(dtype), True, batch, dev, compiled=True, graphs=True)
    for fn in fns.values():  # warm-up: compilation, allocator, oneDNN primitive caches
        timed(fn, 2, dev)
    times = {name: [] for name in fns}
    names = list(fns)
    # each round starts at another variant: no variant always runs after the same one
    for i in range(rounds if names else 0):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(timed(fns[name], steps, dev))
    peak = mfu_peak_tflops(dev, training_dtype(dtype), fp8=fp8_recipe(dtype))
    flops = Shape.from_args(args).flops_per_token(seq_len)
    row = {
        "preset": preset,
        "dtype": dtype,
        "device": dev.type,
        "threads": torch.get_num_threads(),
        "batch": batch_size,
        "seq_len": seq_len,
        "peak_tflops": peak,
        "peak_tflops_fp32": device_peak_tflops(dev, torch.float32),
        "meshtrain_arithmetic": arithmetic_label(resolve(configs["meshtrain"], args, dev)[0].training),
        "hf_loop": hf_loop(dtype),
    }
    if skipped:
        row["skipped"] = skipped
    for name, ts in times.items():
        tok_s = batch_size * seq_len / statistics.median(ts)
        row[f"{name}_tokens_per_s"] = tok_s
        row[f"{name}_mfu"] = tok_s * flops / 1e12 / peak if peak else 0.0
        row[f"{name}_loss"] = float(fns[name].loss)
        if (scale := fns[name].loss_scale()) is not None:
            row[f"{name}_loss_scale"] = scale
    pairs = [(name, base) for name in MESHTRAIN for base in HF if name in times and base in times]
    best = {
        side: max((n for n in names if n in times), key=lambda n: row[f"{n}_tokens_per_s"], default=None)
        for side, names in (("meshtrain", MESHTRAIN), ("hf", HF))
    }
    if best["hf"]:
        row["best_meshtrain"], row["best_hf"] = best["meshtrain"], best["hf"]
        pairs.append((best["meshtrain"], best["hf"]))
    for name, base in pairs:
        ratios = [b / t for t, b in zip(times[name], times[base], strict=True)]
        row[f"{name}_vs_{base}"] = statistics.median(ratios)
        row[f"{name}_vs_{base}_range"] = [min(ratios), max(ratios)]
    print(
        f"  {preset} {dtype}: " + (", ".join(f"{n} {row[f'{n}_tokens_per_s']:,.0f} tok/s" for n in fns) or skipped),
        flush=True,
    )
    return row


def ratio(row: dict, name: str | None, base: str | None) -> str:
    if f"{name}_vs_{base}" not in row:
        return "-"
    low, high = row[f"{name}_vs_{base}_range"]
    return f"{row[f'{name}_vs_{base}']:.2f}x ({low:.2f}-{high:.2f})"


def table(rows: list[dict]) -> str:
    def cell(r, name, fmt):
        return fmt(r) if f"{name}_tokens_per_s" in r else "-"

    header = [
        "preset",
        "dtype (meshtrain arithmetic)",
        "hf loop",
        *[f"{n} tok/s (MFU)" for n in VARIANTS],
        "meshtrain / hf (range over rounds)",
        "meshtrain+compile / hf+compile",
        "best meshtrain / best hf",
        "MFU peak TFLOP/s (fp32)",
    ]
    lines = [
        [
            r["preset"],
            f"{r['dtype']} ({r['meshtrain_arithmetic']})",
            r["hf_loop"],
            *[cell(r, n, lambda r, n=n: f"{r[f'{n}_tokens_per_s']:,.0f} ({r[f'{n}_mfu']:.0%})") for n in VARIANTS],
            ratio(r, "meshtrain", "hf"),
            ratio(r, "meshtrain+compile", "hf+compile"),
            f"{ratio(r, r.get('best_meshtrain'), r.get('best_hf'))} ({r.get('best_meshtrain', '-')} / "
            f"{r.get('best_hf', '-')})"
            if "best_hf" in r
            else r.get("skipped", "-"),
            f"{r['peak_tflops']:.3f} ({r['peak_tflops_fp32']:.3f})",
        ]
        for r in rows
    ]
    return markdown(header, lines)


def main(a) -> list[dict]:
    rows = [
        run(preset, dtype, a.batch, a.seq_len, a.steps, a.rounds)
        for preset in a.presets.split(",")
        for dtype in a.dtypes.split(",")
    ]
    write_results("throughput", rows, table(rows))
    return rows
