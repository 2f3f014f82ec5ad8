"""Single-process training throughput: meshtrain against Hugging Face `LlamaForCausalLM` of the same
shape, trained with a plain PyTorch loop (same AdamW hyperparameters, batch, sequence length,
thread count, SDPA attention, autocast), timed in interleaved rounds in one process so machine
noise hits every variant alike. A ratio is the median over rounds of the ratio within a round (the
host's speed drifts between rounds, far less within one), reported with its range over rounds.
MFU is against the matmul peak measured in the same run.

Variants:
  meshtrain           meshtrain's own step (`parallelize` + `train_step`: fused AdamW, clipping)
  meshtrain+compile   the same with training.compile = true (one process: the whole model and the loss compiled)
  meshtrain+compile/bf16-kernels
                      bf16 rows only: training.bf16_compute = "bf16", i.e. bf16 kernels whatever
                      "auto" measured (= the first two where "auto" picks them)
  hf                  the plain loop: torch.optim.AdamW with its defaults, clip_grad_norm_
  hf+fused            the plain loop with fused AdamW: isolates the model code from the optimizer
  hf+compile          the strongest peer: the whole HF model under torch.compile, fused AdamW

Each row also compares meshtrain's best variant with the best HF variant. MFU is against the best
dense peak the device has for the row's dtype (bf16 on a CPU: the larger of its bf16 and fp32
matmul peaks), whatever arithmetic a variant ran. Where bf16 kernels are emulated (a CPU without
bf16 instructions, bf16 work many times slower than fp32), the variants that would run them (the HF
loops under autocast, bf16-kernels) are skipped in bf16 rows and the row says so: one of their
steps would take minutes.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.common import device, markdown, timed, write_results
from meshtrain.config import load_config
from meshtrain.hardware import device_peak_tflops, mfu_peak_tflops
from meshtrain.interop.families import args_to_config
from meshtrain.model.shapes import Shape
from meshtrain.train import build
from meshtrain.train.arithmetic import resolve

NATIVE = "meshtrain+compile/bf16-kernels"
MESHTRAIN = ("meshtrain", "meshtrain+compile", NATIVE)
HF = ("hf", "hf+fused", "hf+compile")
VARIANTS = (*MESHTRAIN, *HF)
EMULATED_BF16 = 4.0  # bf16 kernels this many times slower than fp32 arithmetic: not run in the bench


def bf16_kernel_slowdown(dtype: str, dev: torch.device, preset: str = "tiny") -> float:
    """How many times slower all-bf16 kernels are than fp32 arithmetic on bf16 storage here, as
    training.bf16_compute = "auto" measured it for the preset (1 outside bf16 on a CPU)."""
    if dtype != "bf16" or dev.type != "cpu":
        return 1.0
    cfg = load_config(overrides={"model.preset": preset, "training.dtype": "bf16"})
    step_ms = resolve(cfg, cfg.model_args(), dev)[1].step_ms
    return step_ms["bf16"] / step_ms["bf16/fp32"]


def meshtrain_config(preset: str, dtype: str, compile: bool, bf16_compute: str, batch: tuple):
    inputs, _ = batch
    return load_config(
        overrides={
            "model.preset": preset,
            "training.dtype": dtype,
            "training.compile": compile,
            "training.bf16_compute": bf16_compute,
            "training.seq_len": inputs.shape[1],
            "training.global_batch_size": len(inputs),
            "training.micro_batch_size": len(inputs),
            "training.lr": 3e-4,
        }
    )


def meshtrain_step(cfg, batch: tuple):
    state = build(cfg, with_data=False)
    return lambda: state.step(*batch)


def hf_step(args, dtype: str, fused: bool, batch: tuple, dev: torch.device, compiled: bool = False):
    """What a user writes around transformers: forward, loss, backward, clip, AdamW (optionally the
    whole model under torch.compile)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    exported = args_to_config(args, "float32", None, [])
    config = LlamaConfig(**{k: v for k, v in exported.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(dev)
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True if fused else None
    )
    inputs, targets = batch

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = forward(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def run(preset: str, dtype: str, batch_size: int, seq_len: int, steps: int, rounds: int) -> dict:
    dev = device()
    args = load_config(overrides={"model.preset": preset}).model_args()
    tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
    configs = {
        "meshtrain": meshtrain_config(preset, dtype, False, "auto", batch),
        "meshtrain+compile": meshtrain_config(preset, dtype, True, "auto", batch),
    }
    slowdown = bf16_kernel_slowdown(dtype, dev, preset)
    bf16_kernels = slowdown < EMULATED_BF16
    if dtype == "bf16" and bf16_kernels:
        configs[NATIVE] = meshtrain_config(preset, dtype, True, "bf16", batch)
    fns = {name: meshtrain_step(cfg, batch) for name, cfg in configs.items()}
    if dtype != "bf16" or bf16_kernels:
        fns["hf"] = hf_step(args, dtype, False, batch, dev)
        fns["hf+fused"] = hf_step(args, dtype, True, batch, dev)
        fns["hf+compile"] = hf_step(args, dtype, True, batch, dev, compiled=True)
    for fn in fns.values():  # warm-up: compilation, allocator, oneDNN primitive caches
        timed(fn, 2, dev)
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(rounds):  # each round starts at another variant: no variant always runs after the same one
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(timed(fns[name], steps, dev))
    peak = mfu_peak_tflops(dev, dtype)
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
        "meshtrain_arithmetic": resolve(configs["meshtrain"], args, dev)[1].name,
    }
    if not bf16_kernels:
        row["skipped"] = (
            f"bf16 kernels are {slowdown:.0f}x slower than fp32 arithmetic on this CPU (emulated): "
            "the variants that run them were not run"
        )
    for name, ts in times.items():
        tok_s = batch_size * seq_len / statistics.median(ts)
        row[f"{name}_tokens_per_s"] = tok_s
        row[f"{name}_mfu"] = tok_s * flops / 1e12 / peak if peak else 0.0
    pairs = [(name, base) for name in configs for base in HF if base in times]
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
    print(f"  {preset} {dtype}: " + ", ".join(f"{n} {row[f'{n}_tokens_per_s']:,.0f} tok/s" for n in fns), flush=True)
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
