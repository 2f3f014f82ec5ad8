"""The planner inside `meshtrain train`: a warning before the model is materialised when the
layout is predicted not to fit, and (run.plan_check) the prediction next to what the run measured."""

from __future__ import annotations

import os

import torch

from meshtrain.config import Config
from meshtrain.logs import log
from meshtrain.model.llama import ModelArgs
from meshtrain.plan.layout import Layout, Workload
from meshtrain.plan.memory import estimate_memory, model_state_bytes
from meshtrain.plan.shapes import Shape

GIB = 2**30


def workload_of(cfg: Config, args: ModelArgs, device: torch.device) -> Workload:
    from meshtrain.parallel.precision import wants_fp32_compute

    t = cfg.training
    return Workload(
        Shape.from_args(args),
        t.seq_len,
        t.global_batch_size,
        t.dtype,
        wants_fp32_compute(t, device),
        device="cuda" if device.type == "cuda" else "cpu",
        compiled=t.compile,
    )


def device_capacity(device: torch.device, local_world_size: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local_world_size)


def warn_if_too_big(cfg: Config, args: ModelArgs, world_size: int, device: torch.device, local_world_size: int) -> None:
    runtime = 1.0 if device.type == "cuda" else 0.0
    predicted = estimate_memory(
        workload_of(cfg, args, device),
        Layout.from_config(cfg, world_size),
        runtime,
        0.05 if device.type == "cuda" else 0.0,
    )["total"]
    capacity = device_capacity(device, local_world_size)
    if predicted > capacity:
        log.warning(
            f"the planner predicts {predicted / GIB:.1f} GiB on the busiest rank for this layout, more than "
            f"the {capacity / GIB:.1f} GiB of {device.type} memory per rank: expect running out of memory; "
            f"`meshtrain plan --config <this config> --gpu ... --gpus {world_size}` shows layouts that fit"
        )


def compare(cfg: Config, args: ModelArgs, device: torch.device, measured: list[dict[str, int]]) -> list[str]:
    """One line per rank: predicted vs measured model states, and the predicted peak."""
    w, layout = workload_of(cfg, args, device), Layout.from_config(cfg, len(measured))
    peak = estimate_memory(w, layout)["total"]
    lines = []
    for rank, got in enumerate(measured):
        predicted = model_state_bytes(w.shape, layout, rank)
        states = " | ".join(f"{k} {predicted[k] / 2**20:.2f}/{got[k] / 2**20:.2f}" for k in predicted)
        lines.append(
            f"rank {rank} planner/measured MiB: {states} | predicted peak of a step {peak / 2**20:.1f} "
            f"MiB (busiest rank; tensors only, the process adds its runtime)"
        )
    return lines
