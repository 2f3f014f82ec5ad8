"""What `training.dtype = "auto"` picks on this machine, against every arithmetic forced by hand and
against the Hugging Face loops, for 1 and 2 processes.

meshtrain: `meshtrain train` as a user runs it, one fresh process (every core) or `--nproc 2` (DDP,
a core each, as `make train` runs), compiled (and eagerly, as `make train` runs, for the presets in
`--arithmetic-eager`), in each arithmetic (fp32; bf16 storage with bf16
kernels, fp32 arithmetic, bf16 GEMMs + fp32 attention, fp32 GEMMs + bf16 attention) and in auto
(which probes at its own thread count), the steady tokens/s from metrics.jsonl, the runs in an order
that alternates between rounds. Every variant gets a fresh process: many compiled models in one
process slowed one of them 2.5x in an earlier version of this bench (small, bf16 GEMMs + fp32
attention: 735 tokens/s there, 1,860 alone).

Hugging Face (the baseline): the plain loop and the whole model under torch.compile, each in fp32
and in bf16 autocast, in one fresh process on every core, timed in interleaved rounds there
(throughput.py's loop), once before meshtrain's runs and once after (a shared VM's speed drifts by
20-30% over the minutes between: one run read HF+compile bf16 at 2,563 tokens/s, the next at
2,033); each HF column is the faster of the two looks.

`auto / fastest`: the tokens/s of the choice auto picks over the fastest forced choice's, both
forced runs (the bar: >= 0.95); the auto column is auto's own runs, a separate measurement of the
same arithmetic that shows the spread between runs.
`fastest / hf+compile`: the fastest meshtrain choice over the faster of HF+compile's fp32 and bf16.

Where bf16 kernels are emulated (a CPU without bf16 instructions), an arithmetic the start-up probe
times at EMULATED_BF16 or more times its fastest candidate is not run (one `small` step would take
minutes), nor are the HF loops under bf16 autocast: their cells read "-" and a note under the
table names the slowdowns. Were auto to pick one of those, its own runs would stand in for the forced one.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import data_overrides, device, markdown, run_train, steady_tokens_per_s, timed, write_results
from bench.throughput import EMULATED_BF16, HFStep
from meshtrain.config import load_config
from meshtrain.hardware import mfu_peak_tflops
from meshtrain.job.arithmetic import CANDIDATES, resolve
from meshtrain.job.model import model_args
from meshtrain.model.shapes import Shape

CHOICES = {name: (dtype, compute) for name, dtype, compute in CANDIDATES}
HF = {"hf fp32": ("fp32", False), "hf bf16": ("bf16", False), "hf+compile fp32": ("fp32", True)}
HF["hf+compile bf16"] = ("bf16", True)


def hf_tokens_per_s(preset: str, a, skip: frozenset[str]) -> dict[str, float]:
    """The HF loops' tokens/s, interleaved in this (fresh) process (the loops in `skip` not run)."""
    dev, batch, seq_len, steps, rounds = device(), a.batch, a.seq_len, a.steps, a.rounds
    args = model_args(load_config(overrides={"model.preset": preset}))
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    data = (tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
    hf = {name: how for name, how in HF.items() if name not in skip}
    fns = {name: HFStep(args, dtype, True, data, dev, compiled) for name, (dtype, compiled) in hf.items()}
    for fn in fns.values():  # compilation, allocator, oneDNN's kernel caches
        timed(fn, 2, dev)
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(fns[name], steps, dev))
    return {name: batch * seq_len / statistics.median(ts) for name, ts in times.items()}


def emulated(preset: str, a) -> dict[str, float]:
    """The arithmetics (and HF loops) not worth running here: each one's slowdown against the fastest
    candidate, as the start-up probe of `training.dtype = "auto"` times them at the bench's shape."""
    overrides = {"model.preset": preset, "training.dtype": "auto", "training.seq_len": a.seq_len}
    overrides |= {"training.micro_batch_size": a.batch, "training.global_batch_size": a.batch}
    cfg = load_config(overrides=overrides)
    step_ms = resolve(cfg, model_args(cfg), device())[1].step_ms
    if not step_ms:  # a GPU: no probe, every arithmetic runs
        return {}
    slowdown = {name: ms / min(step_ms.values()) for name, ms in step_ms.items()}
    slow = {name: x for name, x in slowdown.items() if x >= EMULATED_BF16}
    if "bf16" in slow:  # the HF loops under bf16 autocast run bf16 kernels throughout
        slow |= {name: slow["bf16"] for name, (dtype, _) in HF.items() if dtype == "bf16"}
    return slow


def meshtrain_runs(preset: str, procs: int, compiled: bool, a, skip: frozenset[str]):
    """(tokens/s of each forced arithmetic not in `skip` and of auto, auto's pick) from `meshtrain
    train` runs."""
    batch, seq_len, steps, rounds = a.batch, a.seq_len, a.train_steps, a.arithmetic_rounds

    def flags(dtype: str, compute: str) -> list[str]:
        given = {"model.preset": preset, "training.dtype": dtype, "training.bf16_compute": compute}
        given |= {"training.compile": str(compiled).lower(), "training.seq_len": seq_len, "training.lr": 3e-4}
        given |= {"training.global_batch_size": procs * batch, "training.micro_batch_size": batch}
        given |= {"training.steps": steps, "training.warmup_steps": 1, "training.eval_batches": 1}
        return [x for k, v in given.items() for x in (f"--{k}", str(v))] + ["--run.log_every", "1"]

    runs = {name: flags(dtype, compute) for name, (dtype, compute) in CHOICES.items() if name not in skip}
    runs["auto"] = flags("auto", "auto")
    measured, picked = {name: [] for name in runs}, ""
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, extra in list(runs.items())[:: 1 if r % 2 == 0 else -1]:
                run_dir = Path(tmp) / f"{name.replace('/', '-')}-{r}"
                metrics, _ = run_train(run_dir, [*extra, *data_overrides(a)], nproc=procs)
                measured[name].append(steady_tokens_per_s(metrics))
                if name == "auto":
                    picked = metrics[-1]["arithmetic"]
    return {name: statistics.median(v) for name, v in measured.items()}, picked


def row(preset, procs, threads, compiled, picked, tok_s, args, seq_len) -> dict:
    forced = {name: tok_s[name] for name in CHOICES if name in tok_s}
    fastest = max(forced, key=forced.get)
    auto = tok_s.get("auto") or forced[picked]  # auto's own runs: a second look at its pick's speed
    # a pick the bench skipped as emulated (auto probes compiled, or at fewer threads): its own runs stand in
    pick = forced.get(picked, auto)
    out = {"preset": preset, "processes": procs, "threads": threads, "compiled": compiled, "auto_picks": picked}
    out |= {"fastest": fastest, "tokens_per_s": tok_s, "auto_vs_fastest": pick / forced[fastest]}
    hf_compiled = [tok_s[name] for name in ("hf+compile fp32", "hf+compile bf16") if name in tok_s]
    if hf_compiled and compiled:
        out["best_vs_hf_compile"] = forced[fastest] / max(hf_compiled)
        out["auto_vs_hf_compile"] = auto / max(hf_compiled)
    flops = Shape.from_args(args).flops_per_token(seq_len)
    peak = mfu_peak_tflops(device(), "bf16")  # the machine's: the larger of its bf16 and fp32 matmul peaks, every core
    out["mfu"] = {name: v * flops / 1e12 / peak for name, v in tok_s.items()}
    mode = "compiled" if compiled else "eager"
    speeds = ", ".join(f"{n} {v:,.0f}" for n, v in tok_s.items())
    print(f"  {preset} x{procs} {mode}: auto -> {picked}, {speeds}", flush=True)
    return out


def table(rows: list[dict]) -> str:
    columns = [*CHOICES, "auto", *HF]
    header = ["preset", "processes x threads", "compile", *[f"{c} tok/s" for c in columns], "auto picks"]
    header.append("auto / fastest")
    header.append("fastest / best hf+compile")

    def cell(r, c):
        v = r["tokens_per_s"].get(c, r["tokens_per_s"].get(r["auto_picks"]) if c == "auto" else None)
        return "-" if v is None else f"{v:,.0f} ({r['mfu'].get(c, r['mfu'].get(r['auto_picks'], 0)):.0%})"

    lines = [
        [
            r["preset"],
            f"{r['processes']} x {r['threads']}",
            "yes" if r.get("compiled", True) else "no",
            *[cell(r, c) for c in columns],
            r["auto_picks"],
            f"{r['auto_vs_fastest']:.2f}",
            f"{r['best_vs_hf_compile']:.2f}x" if "best_vs_hf_compile" in r else "-",
        ]
        for r in rows
    ]
    notes = {
        f"- {r['preset']}: not run (the probe's slowdown against the fastest arithmetic): "
        + ", ".join(f"{name} {x:.0f}x" for name, x in r["not_run"].items())
        for r in rows
        if r.get("not_run")
    }
    return markdown(header, lines) + ("\n" + "".join(f"\n{n}" for n in sorted(notes)) if notes else "")


def hf_look(preset: str, a, skip: frozenset[str]) -> dict[str, float]:
    """The HF loops' tokens/s, measured in a fresh process."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        return fresh.submit(hf_tokens_per_s, preset, a, skip).result()


def main(a) -> list[dict]:
    presets = a.presets.split(",")
    eager = ["tiny"] if a.arithmetic_eager is None and "tiny" in presets else (a.arithmetic_eager or "").split(",")
    if unknown := sorted(set(eager) - set(presets) - {""}):
        raise SystemExit(f"--arithmetic-eager {','.join(unknown)}: not among --presets {a.presets}")
    rows = []
    for preset in a.presets.split(","):
        not_run = emulated(preset, a)
        skip = frozenset(not_run)
        looks = [hf_look(preset, a, skip)]
        args = model_args(load_config(overrides={"model.preset": preset}))
        measured = []
        for compiled in (True, False) if preset in eager else (True,):
            for procs in (1, 2) if device().type == "cpu" else (1,):
                tok_s, picked = meshtrain_runs(preset, procs, compiled, a, skip)
                measured.append((procs, compiled, tok_s, picked))
        looks.append(hf_look(preset, a, skip))  # a VM's speed drifts over the minutes between: HF before and after
        hf = {name: max(look[name] for look in looks) for name in looks[0]}  # the faster look: the stronger baseline
        for procs, compiled, tok_s, picked in measured:
            threads = torch.get_num_threads() // procs
            out = row(preset, procs, threads, compiled, picked, tok_s | hf, args, a.seq_len)  # HF: every core
            rows.append(out | {"hf_looks": looks, "not_run": not_run})
    write_results("arithmetic", rows, table(rows))
    return rows
