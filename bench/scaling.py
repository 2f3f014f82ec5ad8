"""Scaling on this machine: one process using every core against one process per core (on a GPU
machine: one GPU against one process per GPU, bf16) under each layout, through `meshtrain train`
as a user runs it. Efficiency = layout tokens/s / single-process tokens/s (same global batch,
model and step count), so 100% means splitting the work over processes cost nothing."""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import data_overrides, markdown, run_train, steady_tokens_per_s, write_results

LAYOUTS = {
    "DDP": ["--parallel.zero", "0"],
    "ZeRO-1": ["--parallel.zero", "1"],
    "ZeRO-2 (FSDP2)": ["--parallel.zero", "2"],
    "ZeRO-3 (FSDP2)": ["--parallel.zero", "3"],
    "TP 2": ["--parallel.tp", "2"],
    "PP 2 (1f1b)": ["--parallel.pp", "2", "--training.micro_batch_size", "4"],
}


def efficiency(row: dict) -> str:
    """The median efficiency, with each round's in brackets when there were several."""
    runs = row.get("efficiency_runs", [])
    return f"{row['efficiency']:.0%}" + (f" ({', '.join(f'{e:.0%}' for e in runs)})" if len(runs) > 1 else "")


def main(a) -> list[dict]:
    gpus = torch.cuda.device_count()
    procs = a.procs or gpus or os.cpu_count()
    if procs < 2:
        print("  skipped: one device (scaling needs at least two)", flush=True)
        return []
    dtype = "bf16" if gpus else "fp32"
    common = [
        "--model.preset",
        a.scaling_preset,
        "--training.dtype",
        dtype,
        "--training.steps",
        str(a.train_steps),
        "--training.warmup_steps",
        "2",
        "--training.global_batch_size",
        "16",
        "--training.micro_batch_size",
        "8",
        "--training.seq_len",
        "256",
        "--training.eval_batches",
        "1",
        "--run.log_every",
        "1",
        *data_overrides(a),
    ]
    with tempfile.TemporaryDirectory() as tmp:

        def measure(name: str, nproc: int, threads: int | None, extra: list[str], tag: str) -> dict:
            run_dir = Path(tmp) / (name.replace(" ", "_") + tag)
            metrics, memory = run_train(run_dir, [*common, *extra], nproc, threads)
            row = {
                "layout": name,
                "processes": nproc,
                "threads_per_process": threads,
                "tokens_per_s": steady_tokens_per_s(metrics),
                "final_loss": metrics[-1]["loss"],
                "peak_rss_mib": max(r["peak_rss"] for r in memory) / 2**20,
            }
            print(f"  {name}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
            return row

        # Rounds of [every layout, then the baseline], after one baseline run: each layout is
        # compared with the mean of the baseline runs just before and after it, so a slow phase of
        # a shared machine weighs on both sides; per layout, the median over rounds.
        singles = [measure("single process", 1, None if gpus else procs, [], "-0")]
        runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
        for r in range(a.scaling_rounds):
            this_round = {name: measure(name, procs, 1, extra, f"-{r}") for name, extra in LAYOUTS.items()}
            singles.append(measure("single process", 1, None if gpus else procs, [], f"-{r + 1}"))
            reference = (singles[-2]["tokens_per_s"] + singles[-1]["tokens_per_s"]) / 2
            for name, run in this_round.items():
                runs[name].append({**run, "efficiency": run["tokens_per_s"] / reference})
        rows = [
            {
                **singles[0],
                "tokens_per_s": statistics.median(s["tokens_per_s"] for s in singles),
                "tokens_per_s_runs": [s["tokens_per_s"] for s in singles],
                "efficiency": 1.0,
            }
        ]
        for layout_runs in runs.values():
            effs = [run["efficiency"] for run in layout_runs]
            rows.append(
                {
                    **layout_runs[0],
                    "efficiency": statistics.median(effs),
                    "efficiency_runs": effs,
                    "tokens_per_s": statistics.median(run["tokens_per_s"] for run in layout_runs),
                }
            )
    lines = [
        [
            r["layout"],
            f"{r['processes']} x {r['threads_per_process'] or 'GPU'}",
            f"{r['tokens_per_s']:,.0f}",
            efficiency(r),
            f"{r['final_loss']:.4f}",
            f"{r['peak_rss_mib']:,.0f}",
        ]
        for r in rows
    ]
    write_results(
        "scaling",
        rows,
        markdown(
            [
                "layout",
                "processes x threads",
                "tokens/s",
                "efficiency",
                "loss at the last step",
                "peak RSS / rank (MiB)",
            ],
            lines,
        ),
    )
    return rows
