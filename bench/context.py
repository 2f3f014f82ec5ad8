"""Long sequences: tokens/s and peak memory per rank against the sequence length, on one process
(every core as its threads) and with context parallelism over 2 processes (`--parallel.cp 2
--nproc 2`, one thread each: DeepSpeed-Ulysses all-to-all attention, parallel/context_parallel.py),
through `meshtrain train` as a user runs it: global batch 1 (one sequence per step), pure causal
attention (training.document_masking false; `--context-masked` adds masked rows), fp32 by default.

Tokens/s is the median of a run's logged steps after the first (one-time kernel set-up and first
touches of the allocator's pages); a length whose runs are one step (the long ones: a step there is
minutes on a CPU) times that first step. Lengths up to 4k run in rounds, the variants' order
alternating; the table keeps each variant's best round (the one least disturbed by other jobs on a
shared machine) and shows each round's ratio in brackets. Peak memory is each rank's peak RSS (VmHWM, memory.json,
read after the first steps) or, on a GPU, its peak allocated memory. A length whose one-process
run would not fit in the memory available now (extrapolated from the shorter lengths' peaks, linear
in the length: the CPU's flash attention keeps no length x length scores) is skipped and said so,
as is one longer than the corpus's validation split (the run evaluates one window at its end)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import data_overrides, markdown, run_train, write_results

VARIANTS = ("1 process", "CP 2")
ROUNDS_UP_TO = 4096  # longer lengths run once: a round there costs minutes on 2 cores
MIB = 2**20


def steps_for(length: int, most: int) -> int:
    """Steps per run: `most` up to 4k tokens, fewer above (3 at 8k, 1 from 16k)."""
    return max(1, min(most, 3 * 8192 // length))


def skipped_first(steps: int) -> int:
    return 0 if steps == 1 else 1 if steps <= 3 else 2


def available_bytes() -> int | None:
    """MemAvailable (Linux), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def corpus_tokens(a) -> dict | None:
    """The prepared corpus's train and validation token counts (None before it is built)."""
    manifest = Path(a.data_path or "data/stdlib") / "manifest.json"
    if not manifest.exists():
        return None
    m = json.loads(manifest.read_text())
    return {"train": m["train_tokens"], "val": m["val_tokens"]}


def estimate_peak(length: int, measured: dict[int, int]) -> int | None:
    """One process's peak at `length`, extrapolated linearly from the two longest measured."""
    if len(measured) < 2:
        return None
    (l0, p0), (l1, p1) = sorted(measured.items())[-2:]
    return int(p1 + (p1 - p0) / (l1 - l0) * (length - l1))


def main(a) -> list[dict]:
    gpus = torch.cuda.device_count()
    cores = os.cpu_count() or 1
    if not gpus and cores < 2 or gpus == 1:
        print("  skipped: one device (CP 2 needs two cores or two GPUs)", flush=True)
        return []
    dtype = a.context_dtype
    rows, measured, skipped = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:

        def run(variant: str, length: int, steps: int, masking: bool, tag: str) -> dict:
            extra = ["--parallel.cp", "2"] if variant == "CP 2" else []
            overrides = [
                "--model.preset",
                a.context_preset,
                "--model.max_seq_len",
                str(length),
                "--training.seq_len",
                str(length),
                "--training.dtype",
                dtype,
                "--training.steps",
                str(steps),
                "--training.warmup_steps",
                "1",
                "--training.global_batch_size",
                "1",
                "--training.micro_batch_size",
                "1",
                "--training.document_masking",
                str(masking).lower(),
                "--training.eval_every",
                "0",
                "--training.eval_batches",
                "1",
                "--run.log_every",
                "1",
                *data_overrides(a),
                *extra,
            ]
            nproc = 2 if variant == "CP 2" else 1
            threads = None if gpus else cores // nproc
            load = os.getloadavg()[0]
            run_dir = Path(tmp) / f"{length}-{variant.replace(' ', '')}-{tag}"
            metrics, ranks = run_train(run_dir, overrides, nproc, threads, timeout=3600)
            skip = skipped_first(steps)
            tokens_per_s = statistics.median(m["tokens_per_s"] for m in metrics if m["step"] > skip)
            peak = max(r["peak_gpu"] if gpus else r["peak_rss"] for r in ranks)
            print(
                f"  {length:>6} {variant + (' masked' if masking else ''):<16}: {tokens_per_s:,.0f} tok/s, "
                f"peak {peak / MIB:,.0f} MiB per rank ({steps} steps, load {load:.1f})",
                flush=True,
            )
            return {"tokens_per_s": tokens_per_s, "peak": peak, "load": load, "final_loss": metrics[-1]["loss"]}

        cases = [(length, False) for length in a.context_lengths]
        cases += [(length, True) for length in a.context_masked]
        for i, (length, masking) in enumerate(cases):
            corpus = corpus_tokens(a)
            if corpus and min(corpus["train"], corpus["val"]) < length + 1:
                skipped.append(f"{length}: the corpus's validation split holds {corpus['val']:,} tokens")
                print(f"  {length}: skipped ({skipped[-1]})", flush=True)
                continue
            estimate, free = estimate_peak(length, measured), available_bytes()
            if not gpus and estimate and free and estimate > 0.9 * free:
                skipped.append(f"{length}: one process would need ~{estimate / 2**30:.1f} GiB, {free / 2**30:.1f} free")
                print(f"  {length}: skipped ({skipped[-1]})", flush=True)
                continue
            steps = steps_for(length, a.context_steps)
            rounds = a.context_rounds if length <= ROUNDS_UP_TO else 1
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for r in range(rounds):  # alternate which variant goes first, so a slow phase weighs on both
                order = VARIANTS if (i + r) % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    runs[variant].append(run(variant, length, steps, masking, str(r)))
            single, cp = runs["1 process"], runs["CP 2"]
            if not masking:
                measured[length] = max(s["peak"] for s in single)
            row = {
                "seq_len": length,
                "document_masking": masking,
                "steps": steps,
                "timed_from_step": skipped_first(steps) + 1,
                "rounds": rounds,
                "dtype": dtype,
                "threads": None if gpus else [cores, cores // 2],
            }
            for key, variant_runs in (("single", single), ("cp2", cp)):  # the best round: least disturbed
                row[f"{key}_tokens_per_s"] = max(s["tokens_per_s"] for s in variant_runs)
                row[f"{key}_tokens_per_s_runs"] = [s["tokens_per_s"] for s in variant_runs]
                row[f"{key}_peak_mib"] = max(s["peak"] for s in variant_runs) / MIB
                row[f"{key}_load"] = [s["load"] for s in variant_runs]
                row[f"{key}_final_loss"] = variant_runs[-1]["final_loss"]
            row["speed_ratio_runs"] = [c["tokens_per_s"] / s["tokens_per_s"] for s, c in zip(single, cp)]
            row["speed_ratio"] = row["cp2_tokens_per_s"] / row["single_tokens_per_s"]
            row["memory_ratio"] = row["cp2_peak_mib"] / row["single_peak_mib"]
            rows.append(row)
    write_results("context", rows + [{"skipped": s} for s in skipped], table(rows, skipped, bool(gpus)))
    return rows


def table(rows: list[dict], skipped: list[str], gpu: bool) -> str:
    def ratio(r: dict) -> str:
        runs = r["speed_ratio_runs"]
        return f"{r['speed_ratio']:.2f}x" + (f" ({', '.join(f'{x:.2f}' for x in runs)})" if len(runs) > 1 else "")

    def timed(r: dict) -> str:
        first, last = r["timed_from_step"], r["steps"]
        return f"{first}" if first == last else f"{first}-{last}"

    lines = [
        [
            f"{r['seq_len']:,}" + (" masked" if r["document_masking"] else ""),
            timed(r) + (f" x {r['rounds']}" if r["rounds"] > 1 else ""),
            f"{r['single_tokens_per_s']:,.0f}",
            f"{r['cp2_tokens_per_s']:,.0f}",
            ratio(r),
            f"{r['single_peak_mib']:,.0f}",
            f"{r['cp2_peak_mib']:,.0f}",
            f"{r['memory_ratio']:.2f}",
        ]
        for r in rows
    ]
    lines += [[s.split(":")[0], "skipped: " + s.split(": ", 1)[1], "", "", "", "", "", ""] for s in skipped]
    memory = "peak GPU MiB" if gpu else "peak RSS MiB"
    header = ["seq len", "timed steps", "1-proc tok/s", "CP 2 tok/s", "CP 2 / 1-proc"]
    header += [f"1-proc {memory}", f"CP 2 {memory} / rank", "CP 2 / 1-proc"]
    return markdown(header, lines)
