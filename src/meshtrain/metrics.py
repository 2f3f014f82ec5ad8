"""Throughput and MFU over a window of steps, and where metrics are written: JSONL, TensorBoard, the
terminal (rank 0). The peaks MFU divides by come from hardware.py."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from meshtrain.files import write_json, write_text, writing
from meshtrain.logs import log


class Throughput:
    """Tokens/s, achieved TFLOP/s per device and MFU over the window since the last report."""

    def __init__(self, flops_per_token: float, peak_tflops: float, world_size: int, raise_peak=None):
        """`raise_peak` (hardware.mfu_peak_floor): where the peak was measured, a window faster than it
        proves it read low, and raises it (MFU never reads above 100%)."""
        self.flops_per_token, self.peak, self.world = flops_per_token, peak_tflops, world_size
        self.raise_peak = raise_peak
        self.start = self.window_start = time.perf_counter()
        self.window_tokens = 0

    def add(self, tokens: int) -> None:
        self.window_tokens += tokens

    def report(self) -> dict:
        now = time.perf_counter()
        tokens_per_s = self.window_tokens / max(now - self.window_start, 1e-9)
        tflops = tokens_per_s * self.flops_per_token / self.world / 1e12
        self.window_start, self.window_tokens = now, 0
        if self.raise_peak is not None and tflops > self.peak:
            self.peak = self.raise_peak(tflops)
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak > 0 else 0.0,
            "elapsed_s": now - self.start,
        }


class MetricsLogger:
    """Rank 0's metric sinks: metrics.jsonl (one JSON object per logged step), TensorBoard, the
    progress bar and a line per logged step. On other ranks every method is a no-op. A resumed run
    (start_step > 0) first drops the records of steps after start_step: they were logged by the
    attempt that crashed after its last checkpoint and are about to be logged again."""

    def __init__(
        self, run_dir: Path, total_steps: int, enabled: bool, tensorboard: bool, progress: bool, start_step: int = 0
    ):
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from meshtrain.logs import console

        self.run_dir = run_dir
        path = run_dir / "metrics.jsonl"
        kept = (
            [line for line in path.read_text().splitlines() if _step_of(line) <= start_step]
            if start_step and path.is_file()
            else None
        )
        if kept is not None:
            write_text(path, "".join(line + "\n" for line in kept))
        elif not start_step and path.is_file() and path.stat().st_size:
            earlier = keep_earlier_record(path)
            log.warning(f"no checkpoint to continue from: this start begins at step 1 (earlier metrics: {earlier})")
        with writing(path):
            run_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = path.open("a" if start_step else "w")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console(),
            transient=True,
            disable=not (progress and sys.stdout.isatty()),
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
        self.progress.start()

    def advance(self, step: int) -> None:
        if self.enabled:
            self.progress.update(self.task, completed=step)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(strict_json({"step": step, **metrics}), allow_nan=False) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, dict):  # data_mix, val_loss_by_source: one curve per source
                    for name, v in value.items():
                        self.tb.add_scalar(f"{key}/{name}", v, step)
        parts = [f"step {step:>5}"]
        for key, fmt in (
            ("loss", "{:.4f}"),
            ("val_loss", "{:.4f}"),
            ("lr", "{:.2e}"),
            ("grad_norm", "{:.3f}"),
            ("tokens_per_s", "{:,.0f}"),
            ("tflops", "{:.3f}"),
            ("mfu", "{:.1%}"),
        ):
            if key in metrics:
                parts.append(f"{key} {fmt.format(metrics[key])}")
        log.info(" | ".join(parts))
        if "loss" in metrics:
            self.progress.update(
                self.task, status=f"loss {metrics['loss']:.3f} {metrics.get('tokens_per_s', 0):,.0f} tok/s"
            )

    def write_json(self, name: str, obj) -> None:
        if self.enabled:
            write_json(self.run_dir / name, obj)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()


def keep_earlier_record(path: Path) -> Path:
    """Move an earlier start's metrics.jsonl aside (metrics.1.jsonl, .2, ...: the first name free), so
    that a start from step 1 never truncates a record."""
    n = 1
    while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(aside)
    return aside


def strict_json(value):
    """`value` with every NaN or infinity as null: JSON has no such numbers (Python's `json` writes
    `NaN`, which other readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line: dropped
