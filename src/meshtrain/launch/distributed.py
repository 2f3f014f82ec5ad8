"""One process per device: the device, the backend and the process group."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.launch.env import LaunchEnv

NEURON_INSTALL = (
    "pip install torch-neuronx --extra-index-url https://pip.repos.neuron.amazonaws.com, on a trn2/trn3 "
    "instance with the Neuron driver and runtime"
)


def require_device(choice: str) -> None:
    """launch.device names a device this machine's Python can drive: called by the local launcher before
    any worker starts (and by every process as it picks its device), so that a missing SDK is one line
    up front, not N workers' tracebacks."""
    import importlib.util

    if choice == "neuron" and importlib.util.find_spec("torch_neuronx") is None:
        raise ConfigError(f"launch.device = 'neuron' needs torch-neuronx (the Neuron SDK): {NEURON_INSTALL}")


def pick_device(env: LaunchEnv, choice: str = "auto") -> torch.device:
    """launch.device: "auto" takes this process's GPU where there is one, else the CPU; "neuron" (never
    picked by "auto") takes this process's NeuronCore through torch-neuronx's native device."""
    require_device(choice)
    if choice == "neuron":
        return _neuron_core(env)
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("launch.device = 'cuda' but no CUDA device is visible to this process; use auto or cpu")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if env.local_world_size > gpus:
        raise ConfigError(
            f"{env.launcher}: {env.local_world_size} tasks per node but {gpus} GPUs per node; start one task per GPU "
            f"(e.g. srun --ntasks-per-node={gpus}, mpirun -npernode {gpus}), or train on the CPU with "
            "--launch.device cpu"
        )
    return torch.device("cuda", env.local_rank)


def _neuron_core(env: LaunchEnv) -> torch.device:
    """One logical NeuronCore per rank, like one GPU per rank. Importing torch_neuronx registers the
    "neuron" device and its process-group backend (TorchNeuron is a PrivateUse1 backend, driven through
    torch.accelerator). A process the Neuron runtime was given one core (NEURON_RT_NUM_CORES=1 or
    NEURON_RT_VISIBLE_CORES) sees it as core 0; otherwise rank i of the node takes core i."""
    import torch_neuronx  # noqa: F401

    cores = torch.accelerator.device_count()
    if cores == 0:
        raise ConfigError(
            "launch.device = 'neuron' but torch-neuronx sees no NeuronCore; run on a trn2/trn3 instance "
            "(neuron-ls lists its devices), or train with --launch.device auto"
        )
    if cores > 1 and env.local_world_size > cores:
        raise ConfigError(
            f"{env.launcher}: {env.local_world_size} tasks per node but {cores} NeuronCores per node; start one "
            f"task per NeuronCore (e.g. srun --ntasks-per-node={cores})"
        )
    device = torch.device("neuron", env.local_rank if cores > 1 else 0)
    torch.accelerator.set_device_index(device)
    return device


def die_with_parent() -> None:
    """Linux: this process is killed when the process that started it dies, whatever kills it (a
    SIGKILLed launcher must not leave workers training, and holding GPUs, on a cluster node)."""
    import ctypes
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def init_distributed(env: LaunchEnv, choice: str = "auto", timeout: timedelta = timedelta(minutes=10)) -> torch.device:
    """CUDA + NCCL or a NeuronCore + torch-neuronx's "neuron" backend (each with gloo beside it for CPU
    tensors and object collectives), or CPU + gloo.
    A process started by a launcher dies with it. `timeout`: the longest one rank waits for the
    others at a collective."""
    if env.launcher != "single":
        die_with_parent()
    device = pick_device(env, choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.distributed and not dist.is_initialized():
        env.export()
        backend = {"cuda": "cuda:nccl,cpu:gloo", "neuron": "neuron:neuron,cpu:gloo"}.get(device.type, "gloo")
        dist.init_process_group(backend, timeout=timeout)
    return device


def agreed(obj):
    """Rank 0's value of a small picklable object on every rank (itself without a process group):
    for decisions that must not differ between ranks even when the file system changes under them."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
