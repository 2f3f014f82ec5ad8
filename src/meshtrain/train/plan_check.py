"""The planner's word on a job the trainer builds: a warning before the model is materialised when
the predicted peak does not fit the device (`warn_if_too_big`), and with run.plan_check its prediction
of each rank's model states beside what the run measured (`compare`)."""

from __future__ import annotations

import os

import torch

from meshtrain.job import Job
from meshtrain.logs import log
from meshtrain.plan import estimate_memory, model_state_bytes
from meshtrain.plan.workload import workload_of

GIB = 2**30


def device_capacity(device: torch.device, local_world_size: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local_world_size)


def warn_if_too_big(job: Job, local_world_size: int) -> None:
    """A warning before the model is materialised when the planner predicts it will not fit."""
    on_gpu = job.device.type == "cuda"
    predicted = estimate_memory(workload_of(job), job.layout, 1.0 if on_gpu else 0.0, 0.05 if on_gpu else 0.0)
    capacity = device_capacity(job.device, local_world_size)
    if predicted["total"] > capacity:
        log.warning(
            f"the planner predicts {predicted['total'] / GIB:.1f} GiB on the busiest rank for this layout, more "
            f"than the {capacity / GIB:.1f} GiB of {job.device.type} memory per rank: expect running out of memory; "
            f"`meshtrain plan --config <this config> --gpu ... --gpus {job.layout.world}` shows layouts that fit"
        )


def compare(job: Job, measured: list[dict[str, int]]) -> list[str]:
    """run.plan_check: one line per rank, predicted vs measured model states, and the predicted peak."""
    w = workload_of(job)
    peak = estimate_memory(w, job.layout)["total"]
    lines = []
    for rank, got in enumerate(measured):
        predicted = model_state_bytes(w.shape, job.layout, rank, w.peft, w.dtype)
        states = " | ".join(f"{k} {predicted[k] / 2**20:.2f}/{got[k] / 2**20:.2f}" for k in predicted)
        lines.append(
            f"rank {rank} planner/measured MiB: {states} | predicted peak of a step {peak / 2**20:.1f} "
            f"MiB (busiest rank; tensors only, the process adds its runtime)"
        )
    return lines
