"""Memory per rank: parameter, gradient and optimizer-state bytes each rank holds (measured on the
tensors after the first step, from memory.json) and its peak RSS, for ZeRO 0-3 at several world
sizes, with the ratio to DDP at the same world size next to the ZeRO paper's (fp32 AdamW: 4 bytes
of parameters, 4 of gradients, 8 of optimizer states per parameter).

FSDP2's ZeRO-2 (reshard_after_forward=False) gathers parameters for forward and keeps them until
backward ends, then frees them: at rest, when the bytes are counted, they are sharded as in ZeRO-3.
The paper's ZeRO-2 column is what it holds during the step."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.common import data_overrides, markdown, run_train, write_results

STATES = ("params", "grads", "optimizer")


def theory(zero: int, n: int) -> float:
    """Model-state bytes per rank relative to DDP (16 bytes per parameter)."""
    sharded = {0: 0, 1: 8, 2: 12, 3: 16}[zero]
    return ((16 - sharded) + sharded / n) / 16


def main(a) -> list[dict]:
    gpus = torch.cuda.device_count()  # GPU mode: one process per GPU, so worlds up to the GPU count
    worlds = [n for n in a.worlds if not gpus or n <= gpus]
    common = [
        "--model.preset",
        a.memory_preset,
        "--training.dtype",
        "fp32",
        "--training.steps",
        "2",
        "--training.warmup_steps",
        "1",
        "--training.global_batch_size",
        "4",
        "--training.micro_batch_size",
        "1",
        "--training.seq_len",
        "128",
        "--training.eval_batches",
        "1",
        "--run.log_every",
        "1",
        *data_overrides(a),
    ]
    cases = [(1, 0)] + [(n, zero) for n in worlds if n > 1 for zero in (0, 1, 2, 3)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, zero in cases:
            _, ranks = run_train(Path(tmp) / f"w{n}z{zero}", [*common, "--parallel.zero", str(zero)], n, 1)
            row = {"world": n, "zero": zero, **{k: max(r[k] for r in ranks) for k in (*STATES, "peak_rss")}}
            row["model_states"] = sum(row[k] for k in STATES)
            if gpus:
                row["peak_gpu"] = max(r["peak_gpu"] for r in ranks)
            rows.append(row)
            print(f"  world {n} ZeRO-{zero}: {row['model_states'] / 2**20:,.1f} MiB model states per rank", flush=True)
    ddp = {r["world"]: r["model_states"] for r in rows if r["zero"] == 0}
    for r in rows:
        r["ratio_to_ddp"] = r["model_states"] / ddp[r["world"]]
        r["theory"] = theory(r["zero"], r["world"])
    mib = 2**20
    lines = [
        [
            str(r["world"]),
            f"ZeRO-{r['zero']}",
            *[f"{r[k] / mib:,.1f}" for k in (*STATES, "model_states")],
            f"{r['ratio_to_ddp']:.3f}",
            f"{r['theory']:.3f}",
            f"{r.get('peak_gpu', r['peak_rss']) / mib:,.0f}",
        ]
        for r in rows
    ]
    write_results(
        "memory",
        rows,
        markdown(
            [
                "world",
                "stage",
                "params MiB",
                "grads MiB",
                "optimizer MiB",
                "model states MiB",
                "/ DDP",
                "/ DDP (paper)",
                "peak GPU MiB" if gpus else "peak RSS MiB",
            ],
            lines,
        ),
    )
    return rows
