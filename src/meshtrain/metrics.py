"""Throughput, FLOPs and MFU, and where they are written: JSONL, TensorBoard, the terminal (rank 0)."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from meshtrain.errors import MeshtrainError
from meshtrain.files import write_json, write_text, writing
from meshtrain.logs import log

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (bf16, fp32 without TF32).
# Matched by substring of torch.cuda.get_device_name(), most specific first.
GPU_PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("GB200", 2500.0, 80.0),
    ("B200", 2250.0, 80.0),
    ("H200", 989.5, 66.9),
    ("GH200", 989.5, 66.9),
    ("H100 PCIe", 756.5, 51.2),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.5, 66.9),
    ("H800", 989.5, 66.9),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("RTX 4090", 165.2, 82.6),
    ("V100", 125.0, 15.7),  # no bf16: fp16 tensor-core peak
    ("MI300X", 1307.4, 163.4),
    ("MI250X", 383.0, 47.9),
]


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshtrain" / "cpu_peak.json"


def measure_cpu_peak_tflops(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """Best-of-repeats square matmul throughput at this process's thread count, at size n, or at
    the smallest size whose matmul takes over 0.2 s (a CPU without bf16 instructions emulates
    bf16 about 100x slower than fp32: the probe stays within a second or two there too)."""
    size = 256
    while True:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        start = time.perf_counter()
        torch.matmul(a, b)  # warm up, and see how long one takes
        if size >= n or time.perf_counter() - start > 0.2:
            break
        size *= 2
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e12


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_key(dtype: torch.dtype) -> str:
    """A peak holds for one CPU model, core count, thread count and dtype."""
    return f"{cpu_model()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}"


def cached_measurement(key: str, measure, keep_max: bool) -> float:
    """A machine measurement kept in ~/.cache/meshtrain/cpu_peak.json: measured once (keep_max
    False), or again every time keeping the best (keep_max True). A read-only home only loses the record."""
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache and not keep_max:
        return cache[key]
    measured = measure()
    if measured > cache.get(key, -math.inf):
        cache[key] = measured
        try:
            write_json(path, cache)
        except MeshtrainError:
            pass
    return cache[key]


def cpu_peak_tflops(dtype: torch.dtype) -> float:
    """The best matmul throughput ever measured on this (CPU, thread count, dtype). Every run
    probes again (well under a second) and keeps the maximum: a probe taken while the machine was
    busy reads low and would inflate MFU (once 119%), but it can never read high."""
    return cached_measurement(cpu_peak_key(dtype), lambda: measure_cpu_peak_tflops(dtype), keep_max=True)


def mfu_peak_tflops(device: torch.device, training_dtype: str, override: float = 0.0) -> float:
    """What MFU divides by: the best dense peak the device has for the training's dtype, whatever
    arithmetic the step picked (bf16 training on a CPU: the larger of its bf16 and fp32 matmul
    peaks; on a GPU the data sheet's bf16 peak). A slow choice then shows as a low MFU."""
    if training_dtype == "bf16" and device.type == "cpu" and override <= 0:
        return max(cpu_peak_tflops(torch.bfloat16), cpu_peak_tflops(torch.float32))
    return device_peak_tflops(device, torch.bfloat16 if training_dtype == "bf16" else torch.float32, override)


def device_peak_tflops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> float:
    if override > 0:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for pattern, bf16, fp32 in GPU_PEAK_TFLOPS:
            if pattern in name:
                return bf16 if dtype == torch.bfloat16 else fp32
        return 0.0  # unknown GPU: MFU is reported as 0 unless training.peak_tflops is set
    return cpu_peak_tflops(dtype)


class Throughput:
    """Tokens/s, achieved TFLOP/s per device and MFU over the window since the last report."""

    def __init__(self, flops_per_token: float, peak_tflops: float, world_size: int):
        self.flops_per_token, self.peak, self.world = flops_per_token, peak_tflops, world_size
        self.start = self.window_start = time.perf_counter()
        self.window_tokens = 0

    def add(self, tokens: int) -> None:
        self.window_tokens += tokens

    def report(self) -> dict:
        now = time.perf_counter()
        tokens_per_s = self.window_tokens / max(now - self.window_start, 1e-9)
        tflops = tokens_per_s * self.flops_per_token / self.world / 1e12
        self.window_start, self.window_tokens = now, 0
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

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, tensorboard: bool, progress: bool,
                 start_step: int = 0):
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from meshtrain.logs import console

        self.run_dir = run_dir
        path = run_dir / "metrics.jsonl"
        kept = [line for line in path.read_text().splitlines() if _step_of(line) <= start_step] \
            if start_step and path.is_file() else None
        if kept is not None:
            write_text(path, "".join(line + "\n" for line in kept))
        with writing(path):
            run_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = path.open("a" if start_step else "w")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), console=console(), transient=True, disable=not (progress and sys.stdout.isatty()),
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
        self.progress.start()

    def advance(self, step: int) -> None:
        if self.enabled:
            self.progress.update(self.task, completed=step)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
        parts = [f"step {step:>5}"]
        for key, fmt in (("loss", "{:.4f}"), ("val_loss", "{:.4f}"), ("lr", "{:.2e}"), ("grad_norm", "{:.3f}"),
                         ("tokens_per_s", "{:,.0f}"), ("tflops", "{:.3f}"), ("mfu", "{:.1%}")):
            if key in metrics:
                parts.append(f"{key} {fmt.format(metrics[key])}")
        log.info(" | ".join(parts))
        if "loss" in metrics:
            self.progress.update(self.task, status=f"loss {metrics['loss']:.3f} {metrics.get('tokens_per_s', 0):,.0f} tok/s")

    def write_json(self, name: str, obj) -> None:
        if self.enabled:
            write_json(self.run_dir / name, obj)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line: dropped
