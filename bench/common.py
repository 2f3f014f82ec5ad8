"""What every benchmark shares: the device, timing that waits for the device, runs of the real CLI,
and results written as JSON plus a Markdown table."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(os.environ.get("MESHTRAIN_BENCH_RESULTS", Path(__file__).parent / "results"))


def device() -> torch.device:
    """The GPU when there is one (GPU mode: bf16 and NCCL), else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def timed(fn, n: int, dev: torch.device) -> float:
    """Seconds per call over n calls, waiting for queued device work on both ends."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - start) / n


def machine() -> dict:
    from meshtrain.hardware import cpu_model

    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_train(
    run_dir: Path, overrides: list[str], nproc: int = 1, threads: int | None = None, timeout: int = 900
) -> tuple[list[dict], list[dict]]:
    """Run `meshtrain train` as a user would; returns (metrics.jsonl rows, memory.json ranks)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        sys.executable,
        "-m",
        "meshtrain",
        "train",
        "--run.dir",
        str(run_dir),
        "--run.progress",
        "false",
        "--run.tensorboard",
        "false",
        "--run.sample_prompt",
        "",
        "--run.save_model",
        "false",
        *overrides,
    ]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((run_dir / "memory.json").read_text())


def data_overrides(a) -> list[str]:
    """`--data-path DIR`: a prepared data set instead of the default corpus (built on first use)."""
    return ["--data.path", a.data_path, "--data.corpus", ""] if a.data_path else []


def steady_tokens_per_s(metrics: list[dict], skip: int = 2) -> float:
    """Median tokens/s of the logged steps after the first `skip` (compile, allocator warm-up)."""
    return statistics.median(m["tokens_per_s"] for m in metrics if m["step"] > skip and "tokens_per_s" in m)


def write_results(name: str, rows: list[dict], table: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table, flush=True)


def markdown(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)
