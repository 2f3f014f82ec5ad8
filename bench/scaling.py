"""Scaling on this machine: one process using every core against one process per core under each
layout, through `meshtrain train` as a user runs it. Efficiency = layout tokens/s / single-process
tokens/s (same global batch, model and step count), so 100% means splitting the work over
processes cost nothing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.common import markdown, run_train, steady_tokens_per_s, write_results

LAYOUTS = {
    "DDP": ["--parallel.zero", "0"],
    "ZeRO-1": ["--parallel.zero", "1"],
    "ZeRO-2 (FSDP2)": ["--parallel.zero", "2"],
    "ZeRO-3 (FSDP2)": ["--parallel.zero", "3"],
    "TP 2": ["--parallel.tp", "2"],
    "PP 2 (1f1b)": ["--parallel.pp", "2", "--training.micro_batch_size", "4"],
}


def main(a) -> list[dict]:
    procs = a.procs or os.cpu_count()
    common = ["--model.preset", a.scaling_preset, "--training.dtype", "fp32", "--training.steps", str(a.train_steps),
              "--training.warmup_steps", "2", "--training.global_batch_size", "16", "--training.micro_batch_size",
              "8", "--training.seq_len", "256", "--training.eval_batches", "1", "--run.log_every", "1"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        def measure(name: str, nproc: int, threads: int, extra: list[str]) -> dict:
            metrics, memory = run_train(Path(tmp) / name.replace(" ", "_"), [*common, *extra], nproc, threads)
            row = {"layout": name, "processes": nproc, "threads_per_process": threads,
                   "tokens_per_s": steady_tokens_per_s(metrics), "final_loss": metrics[-1]["loss"],
                   "peak_rss_mib": max(r["peak_rss"] for r in memory) / 2**20}
            print(f"  {name}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
            return row

        single = measure("single process", 1, procs, [])
        rows.append({**single, "efficiency": 1.0})
        for name, extra in LAYOUTS.items():
            row = measure(name, procs, 1, extra)
            rows.append({**row, "efficiency": row["tokens_per_s"] / single["tokens_per_s"]})
    lines = [[r["layout"], f"{r['processes']} x {r['threads_per_process']}", f"{r['tokens_per_s']:,.0f}",
              f"{r['efficiency']:.0%}", f"{r['final_loss']:.4f}", f"{r['peak_rss_mib']:,.0f}"] for r in rows]
    write_results("scaling", rows, markdown(
        ["layout", "processes x threads", "tokens/s", "efficiency", "loss at the last step", "peak RSS / rank (MiB)"],
        lines))
    return rows
