"""What document masking costs: meshtrain's training step (TrainState.step: parallelize() +
train_step) on the same packed batch with training.document_masking's positions (each token attends
within its document, model/masks.py) and without (plain causal attention), timed in interleaved
rounds in one process. Documents are a few hundred tokens (lengths drawn from 100-500, seeded), so
every sequence holds several. On a CPU the masked attention runs two ways (masks.KERNEL forced):
"dense", SDPA with a boolean (batch, 1, seq, seq) mask, and "varlen", causal SDPA per document; on
CUDA the masked rows are FlexAttention with a block mask (which skips the blocks outside the
documents) under both names."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.common import device, markdown, timed, write_results
from meshtrain.config import load_config
from meshtrain.model import masks
from meshtrain.train.build import build

VARIANTS = ("causal", "dense", "varlen")


def document_positions(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(batch, seq_len) positions of documents of 100-500 tokens packed back to back."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        row = []
        while len(row) < seq_len:
            row += range(int(rng.integers(100, 501)))
        rows.append(row[:seq_len])
    return torch.tensor(rows, dtype=torch.int64)


def run(preset: str, seq_len: int, batch: int, steps: int, rounds: int) -> dict:
    dev = device()
    cfg = load_config(
        overrides={
            "model.preset": preset,
            "model.max_seq_len": seq_len,
            "training.seq_len": seq_len,
            "training.global_batch_size": batch,
            "training.micro_batch_size": batch,
            "training.dtype": "bf16" if dev.type == "cuda" else "fp32",
            "training.lr": 3e-4,
        }
    )
    state = build(cfg, with_data=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, state.args.vocab_size, (batch, seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
    positions = document_positions(batch, seq_len).to(dev)

    def masked(kernel: str):
        def step():
            masks.KERNEL = None if dev.type == "cuda" else kernel
            try:
                state.step(inputs, targets, None, positions)
            finally:
                masks.KERNEL = None

        return step

    work = {"causal": lambda: state.step(inputs, targets), "dense": masked("dense"), "varlen": masked("varlen")}
    for fn in work.values():  # warm-up: kernels, the optimizer's states
        fn()
    seconds = {name: [] for name in VARIANTS}
    cpu_seconds = {name: [] for name in VARIANTS}  # the process's CPU time: steadier on a loaded host
    for r in range(rounds):
        for name in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            cpu = time.process_time()
            seconds[name].append(timed(work[name], steps, dev))
            cpu_seconds[name].append((time.process_time() - cpu) / steps)
    row = {"preset": preset, "seq_len": seq_len, "batch": batch}
    row["documents_per_sequence"] = float((positions == 0).sum()) / batch
    row["default_kernel"] = masks.DocumentMask(positions).kernel
    for name in VARIANTS:
        row[f"{name}_tokens_per_s"] = batch * seq_len / statistics.median(seconds[name])
        row[f"{name}_cpu_s"] = statistics.median(cpu_seconds[name])
    for name in ("dense", "varlen"):  # speed over causal's: the median of the ratios within a round
        ratios = [c / m for c, m in zip(seconds["causal"], seconds[name])]
        row[f"{name}_over_causal"] = statistics.median(ratios)
        row[f"{name}_range"] = [min(ratios), max(ratios)]
        row[f"{name}_over_causal_cpu_time"] = row["causal_cpu_s"] / row[f"{name}_cpu_s"]
    row["varlen_over_dense_cpu_time"] = row["dense_cpu_s"] / row["varlen_cpu_s"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        [
            r["preset"],
            f"{r['batch']} x {r['seq_len']}",
            f"{r['documents_per_sequence']:.1f}",
            f"{r['causal_tokens_per_s']:,.0f}",
            f"{r['dense_tokens_per_s']:,.0f}",
            f"{r['varlen_tokens_per_s']:,.0f}",
            f"{r['dense_over_causal']:.2f}x ({r['dense_range'][0]:.2f}-{r['dense_range'][1]:.2f})",
            f"{r['varlen_over_causal']:.2f}x ({r['varlen_range'][0]:.2f}-{r['varlen_range'][1]:.2f})",
            f"{r['dense_over_causal_cpu_time']:.2f}x",
            f"{r['varlen_over_causal_cpu_time']:.2f}x",
            f"{r['varlen_over_dense_cpu_time']:.2f}x",
            r["default_kernel"],
        ]
        for r in rows
    ]
    header = ["preset", "batch", "documents / sequence", "causal tok/s", "dense tok/s", "varlen tok/s"]
    header += ["dense / causal speed", "varlen / causal speed", "dense / causal by CPU time"]
    header += ["varlen / causal by CPU time", "varlen / dense by CPU time", "default"]
    return markdown(header, lines)


def main(a) -> list[dict]:
    tokens = a.masking_tokens
    rows = [
        run(a.masking_preset, seq_len, max(1, tokens // seq_len), a.steps, a.masking_rounds)
        for seq_len in a.masking_seq_lens
    ]
    write_results("masking", rows, table(rows))
    return rows
