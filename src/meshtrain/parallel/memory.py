"""What sharding did: bytes of parameters, gradients and optimizer states this rank holds."""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.dtensor import is_dtensor
from meshtrain.optim import local_optimizer


def _local_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds here: a DTensor's local piece; a tensor subclass's inner tensors
    (QLoRA's NF4 weight: its 4-bit codes and scales, not its bf16 shape)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    local = t.to_local() if is_dtensor(t) else t
    if is_traceable_wrapper_subclass(local):
        inner, _ = local.__tensor_flatten__()
        return sum(_local_bytes(getattr(local, name)) for name in inner)
    return local.numel() * local.element_size()


def model_state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Local bytes (DTensor shards count only their local piece; shared tensors once)."""
    seen: set[int] = set()
    unique = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
    states = [
        v
        for state in local_optimizer(optimizer).state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "params": sum(_local_bytes(p) for p in unique),
        "grads": sum(_local_bytes(p.grad) for p in unique if p.grad is not None),
        "optimizer": sum(_local_bytes(s) for s in states),
    }


def peak_memory_bytes() -> dict[str, int]:
    """This process's peak resident set size and, on a GPU, the caching allocator's peak.

    Linux's VmHWM, not getrusage's ru_maxrss: the latter survives fork + exec, so a process
    started by a large one (a benchmark driver) would report its parent's peak."""
    try:
        status = Path("/proc/self/status").read_text()
        rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS
    peak = {"peak_rss": rss}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["peak_gpu"] = torch.cuda.max_memory_allocated()
    return peak


def gather_memory_report(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[dict[str, int]]:
    """Every rank's model-state bytes and peak memory so far, in rank order (a collective)."""
    mine = {**model_state_bytes(params, optimizer), **peak_memory_bytes()}
    if not dist.is_initialized():
        return [mine]
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def format_memory(rank: int, b: dict[str, int]) -> str:
    mib = 2**20
    return (
        f"rank {rank}: params {b['params'] / mib:8.2f} MiB | grads {b['grads'] / mib:8.2f} MiB | "
        f"optimizer {b['optimizer'] / mib:8.2f} MiB | peak RSS {b['peak_rss'] / mib:8.1f} MiB"
        + (f" | peak GPU {b['peak_gpu'] / mib:8.1f} MiB" if "peak_gpu" in b else "")
    )
