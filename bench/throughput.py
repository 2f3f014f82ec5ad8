"""Single-process training throughput: meshtrain vs Hugging Face `LlamaForCausalLM` on the same
shape, same AdamW, batch, sequence length, thread count and SDPA attention, timed in interleaved
rounds in one process (so machine noise hits both alike). MFU is against the matmul peak measured
in the same run. Writes bench/results/throughput.json and prints a Markdown table."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from meshtrain.interop.hf import hf_config
from meshtrain.metrics import measure_cpu_peak_tflops
from meshtrain.model import PRESETS, Llama, flops_per_token
from meshtrain.train import cross_entropy

RESULTS = Path(__file__).parent / "results"


def build_pair(preset: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    args = PRESETS[preset]
    ours = Llama(args)
    ours.init_weights(seed)
    config = LlamaConfig(**{k: v for k, v in hf_config(args, None).items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    theirs = LlamaForCausalLM(config)
    return args, ours, theirs


def make_step(model, forward, dtype, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    inputs, targets = batch

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = forward(inputs)
        loss = cross_entropy(logits, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_steps(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def run(preset: str, dtype: str, batch_size: int, seq_len: int, steps: int, rounds: int) -> dict:
    args, ours, theirs = build_pair(preset)
    tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    steps_fn = {"meshtrain": make_step(ours, ours, dtype, batch),
                "hf": make_step(theirs, lambda x: theirs(input_ids=x).logits, dtype, batch)}
    for fn in steps_fn.values():  # warm-up
        time_steps(fn, 1)
    times = {name: [] for name in steps_fn}
    for _ in range(rounds):
        for name, fn in steps_fn.items():
            times[name].append(time_steps(fn, steps))
    peak = measure_cpu_peak_tflops(torch.bfloat16 if dtype == "bf16" else torch.float32, n=2048, repeats=3)
    flops = flops_per_token(args, seq_len)
    row = {"preset": preset, "dtype": dtype, "threads": torch.get_num_threads(), "batch": batch_size,
           "seq_len": seq_len, "peak_tflops": peak}
    for name, ts in times.items():
        tok_s = batch_size * seq_len / statistics.median(ts)
        row[f"{name}_tokens_per_s"] = tok_s
        row[f"{name}_mfu"] = tok_s * flops / 1e12 / peak
    row["ratio"] = row["meshtrain_tokens_per_s"] / row["hf_tokens_per_s"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench")
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rows = [run(preset, dtype, a.batch, a.seq_len, a.steps, a.rounds)
            for preset in a.presets.split(",") for dtype in a.dtypes.split(",")]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "throughput.json").write_text(json.dumps(rows, indent=1))
    print("| preset | dtype | threads | meshtrain tok/s | HF tok/s | ratio | meshtrain MFU | HF MFU | peak TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['dtype']} | {r['threads']} | {r['meshtrain_tokens_per_s']:,.0f} | "
              f"{r['hf_tokens_per_s']:,.0f} | {r['ratio']:.2f}x | {r['meshtrain_mfu']:.1%} | {r['hf_mfu']:.1%} | "
              f"{r['peak_tflops']:.3f} |")
