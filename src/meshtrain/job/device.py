"""What the device a job trains on must offer, checked where it trains (the launcher on the training
host, and each worker; not jobscript, whose login node may lack the cluster's GPUs): FP8 units for
training.fp8, a GPU for CUDA graphs and CPU offload, the CPU for attention's recomputed backward."""

from __future__ import annotations

import torch

from meshtrain.config import Config
from meshtrain.errors import ConfigError

FP8_CAPABILITY = (8, 9)  # torch._scaled_mm: Ada (sm_89), Hopper (sm_90) and newer


def fp8_refusal(recipe: str, device: torch.device) -> str:
    """Why training.fp8 cannot run on this device ("" if it can)."""
    if recipe == "off" or device.type != "cuda":
        return ""
    capability = torch.cuda.get_device_capability(device)
    if capability >= FP8_CAPABILITY:
        return ""
    name = torch.cuda.get_device_name(device)
    return (
        f"training.fp8 = {recipe!r} needs FP8 units (compute capability 8.9 or newer: Ada, Hopper, Blackwell), but "
        f"{name} has {capability[0]}.{capability[1]}: set training.fp8 = off (bf16 is this GPU's fastest)"
    )


def workers_device(cfg: Config) -> torch.device:
    """The kind of device the workers of `train --nproc` on this host will train on (launch/distributed.py
    picks each one's): for checking it before they start."""
    if cfg.launch.device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device(cfg.launch.device if cfg.launch.device == "neuron" else "cpu")


def check_device(cfg: Config, device: torch.device, launcher: bool = False) -> None:
    """What the device the job trains on must offer (run where it trains: the launcher on the training
    host, and each worker; not jobscript, whose login node may lack the cluster's GPUs): FP8 units
    for training.fp8, a GPU to offload from for parallel.cpu_offload. The `launcher` leaves the FP8
    units to its workers: asking CUDA for them would hold a context on GPU 0 for the whole job."""
    if not launcher and (problem := fp8_refusal(cfg.training.fp8, device)):
        raise ConfigError(problem)
    if cfg.training.attention_backward == "recompute" and device.type != "cpu":
        raise ConfigError(
            f"training.attention_backward = 'recompute' replaces the CPU flash-attention backward, but this job trains "
            f"on {device.type}, whose attention kernels it keeps: set training.attention_backward = auto (or flash)"
        )
    if cfg.training.cuda_graphs and device.type != "cuda":
        raise ConfigError(
            f"training.cuda_graphs replays the step's kernels as CUDA graphs, but this job trains on {device.type}: "
            "drop training.cuda_graphs (or train on a GPU)"
        )
    if cfg.parallel.cpu_offload and device.type == "cpu":
        raise ConfigError(
            "parallel.cpu_offload moves ZeRO-3's shards from GPU memory to host memory, but this job trains on the "
            "CPU, where they already are: drop parallel.cpu_offload (or train on GPUs)"
        )
