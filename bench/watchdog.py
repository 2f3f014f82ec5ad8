"""What hang and straggler detection cost a step: the same model and batches, one process, timed in
interleaved rounds bare and with the watchdog thread running, the step's phase marks and the compute
timer's hooks on every block (what `meshtrain train` adds on every rank)."""

from __future__ import annotations

import statistics

import torch

from bench.common import device, machine, markdown, timed, write_results
from meshtrain.config import load_config
from meshtrain.train.build import build
from meshtrain.train.stragglers import ComputeTimer
from meshtrain.train.watchdog import Watchdog, phase


def main(a) -> list[dict]:
    dev = device()
    cfg = load_config(
        None,
        overrides={
            "model.preset": a.presets.split(",")[0],
            "training.seq_len": a.seq_len,
            "training.global_batch_size": a.batch,
            "training.micro_batch_size": a.batch,
            "launch.device": dev.type,
        },
    )
    state = build(cfg, with_data=False)
    vocab = state.args.vocab_size
    batch = torch.randint(0, vocab, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    blocks = [m for part in state.model.parts for m in part.modules() if type(m).__name__ == "TransformerBlock"]

    def step():
        phase("data", 1)
        x, y = batch[:, :-1], batch[:, 1:]
        phase("forward/backward")
        state.step(x, y)
        phase("logging")

    step()  # warm-up
    seconds = {"bare": [], "watched": []}
    for _ in range(a.rounds):
        seconds["bare"].append(timed(step, a.steps, dev))
        timer = ComputeTimer(blocks, dev)
        with Watchdog("/tmp/meshtrain-bench-watchdog", 0, 1, 300.0, [("", 0)], "bench", dev.type):
            seconds["watched"].append(timed(step, a.steps, dev))
        timer.take()
        timer.remove()
    bare, watched = statistics.median(seconds["bare"]), statistics.median(seconds["watched"])
    row = {**machine(), "preset": cfg.model.preset, "bare_s": bare, "watched_s": watched, "ratio": watched / bare}
    table = markdown(
        ["preset", "step bare (s)", "step watched (s)", "watched / bare"],
        [[cfg.model.preset, f"{bare:.4f}", f"{watched:.4f}", f"{watched / bare:.3f}"]],
    )
    write_results("watchdog", [row], table)
    return [row]
