"""Where a training step's time goes (torch.profiler): matmuls, attention, the optimizer, the
compiled (fused) kernels, other ops, and the time outside any kernel (Python, dispatch, autograd,
graph guards: the host work). On a GPU the kernels are device time and "outside kernels" is the wall
time the device sat idle; on a CPU they are the self time of the ops that compute.

It answers two questions the throughput table cannot: how much of a step is host overhead, and how
far a variant could still go. The matmul rate is the matmul FLOPs over the matmul time; "bound" is
the speed-up left if everything but the matmuls (at their measured rate) took no time at all.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import device, markdown, write_results
from bench.throughput import EMULATED_BF16, HFStep, MeshtrainStep, bf16_kernel_slowdown, meshtrain_config
from meshtrain.config import load_config
from meshtrain.job.model import model_args
from meshtrain.model.shapes import Shape

CATEGORIES = ("matmul", "attention", "optimizer", "compiled", "other")
# Ops that only make views or allocate: host work, not computation.
METADATA_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::view",
    "aten::as_strided",
    "aten::t",
    "aten::transpose",
    "aten::unsqueeze",
    "aten::reshape",
    "aten::permute",
    "aten::expand",
    "aten::detach",
    "aten::select",
    "aten::slice",
    "aten::split",
    "aten::alias",
    "aten::_unsafe_view",
    "aten::resize_",
    "aten::set_",
    "aten::lift_fresh",
}


def category(name: str) -> str:
    """The kind of work of a CPU op or a GPU kernel, from its name."""
    n = name.lower()
    if any(k in n for k in ("scaled_dot_product", "flash", "fmha", "attention")):
        return "attention"
    if n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") or any(
        k in n for k in ("gemm", "nvjet", "xmma", "cutlass")
    ):
        return "matmul"
    if "adam" in n or n.startswith("aten::_foreach"):
        return "optimizer"
    if "compiledfxgraph" in n or "triton" in n:
        return "compiled"
    return "other"


def breakdown(step, steps: int, dev: torch.device) -> dict:
    """Milliseconds per step: wall, each category's kernel time, and the rest (outside kernels)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for _ in range(3):  # warm-up: compilation, allocator, kernel caches
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall = (time.perf_counter() - start) / steps
    ms = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages():
        if dev.type == "cuda":
            if event.device_type.name != "CUDA":  # kernels only: host ops launch, the device computes
                continue
            us = event.self_device_time_total
        elif event.key.startswith(("aten::", "## Call CompiledFxGraph")):
            us = event.self_cpu_time_total
            if category(event.key) == "other" and event.key in METADATA_OPS:
                continue
        else:
            continue
        ms[category(event.key)] += us / 1e3 / steps
    ms["wall"] = wall * 1e3
    ms["outside kernels"] = max(0.0, ms["wall"] - sum(ms[c] for c in CATEGORIES))
    return ms


def main(a) -> list[dict]:
    dev = device()
    rows = []
    for preset in a.presets.split(","):
        for dtype in a.dtypes.split(","):
            args = model_args(load_config(overrides={"model.preset": preset}))
            tokens = torch.randint(
                0, args.vocab_size, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0)
            )
            batch = (tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
            shape = Shape.from_args(args)
            matmul_flops = (
                (shape.flops_per_token(a.seq_len) - 12.0 * shape.n_layers * shape.dim * a.seq_len) * a.batch * a.seq_len
            )
            variants = {"meshtrain+compile": MeshtrainStep(meshtrain_config(preset, dtype, True, "auto", batch), batch)}
            if bf16_kernel_slowdown(dtype, dev, preset) < EMULATED_BF16:  # else an HF step under autocast takes minutes
                variants["hf"] = HFStep(args, dtype, False, batch, dev)
                variants["hf+compile"] = HFStep(args, dtype, True, batch, dev, compiled=True)
            for name, step in variants.items():
                ms = breakdown(step, a.profile_steps, dev)
                rows.append(
                    {
                        "preset": preset,
                        "dtype": dtype,
                        "variant": name,
                        "device": dev.type,
                        "batch": a.batch,
                        "seq_len": a.seq_len,
                        "ms": ms,
                        "matmul_tflops": matmul_flops / (ms["matmul"] / 1e3) / 1e12 if ms["matmul"] else 0.0,
                        "bound": ms["wall"] / ms["matmul"] if ms["matmul"] else 0.0,
                    }
                )
                print(f"  {preset} {dtype} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()), flush=True)
    write_results("profile", rows, table(rows))
    return rows


def table(rows: list[dict]) -> str:
    header = [
        "preset",
        "dtype",
        "variant",
        "ms/step",
        *[f"{c} ms" for c in CATEGORIES],
        "outside kernels ms",
        "matmul TFLOP/s",
        "matmul share",
        "bound (all but matmul free)",
    ]
    lines = [
        [
            r["preset"],
            r["dtype"],
            r["variant"],
            f"{r['ms']['wall']:.1f}",
            *[f"{r['ms'][c]:.1f}" for c in CATEGORIES],
            f"{r['ms']['outside kernels']:.1f}",
            f"{r['matmul_tflops']:.3f}",
            f"{r['ms']['matmul'] / r['ms']['wall']:.0%}",
            f"{r['bound']:.2f}x",
        ]
        for r in rows
    ]
    return markdown(header, lines)
