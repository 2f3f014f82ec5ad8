"""What the planner knows about machines: accelerators (data-sheet peaks, memory, links) and
networks, every number overridable; the CPU is measured on the spot."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from meshtrain.datasheets import GPU_PEAK_TFLOPS
from meshtrain.errors import MeshtrainError

GIB = 2**30


@dataclass(frozen=True)
class Network:
    """Inter-node bus bandwidth per GPU in GB/s (NIC line rate shared by the node's GPUs, at the ~80%
    of line rate that nccl-tests' busbw reaches on a healthy fabric)."""

    name: str
    gbps_per_gpu: float


NETWORKS = {
    n.name: n
    for n in (
        Network("ib-edr", 100 / 8 * 0.8),  # 1 x 100 Gb/s EDR per GPU (DGX-1/DGX-2 era)
        Network("ib-hdr", 200 / 8 * 0.8),  # 1 x 200 Gb/s HDR per GPU (DGX A100)
        Network("ib-ndr", 400 / 8 * 0.8),  # 1 x 400 Gb/s NDR per GPU (DGX H100/H200/B200)
        Network("efa-p4d", 400 / 8 / 8 * 0.8),  # AWS p4d: 4 x 100 Gb/s EFA for 8 GPUs
        Network("efa-p5", 3200 / 8 / 8 * 0.8),  # AWS p5: 32 x 100 Gb/s EFA for 8 GPUs
        Network("roce-100g", 100 / 8 / 8 * 0.8),  # one 100 GbE RoCE port for 8 GPUs
        Network("ethernet-10g", 10 / 8 * 0.8),  # CPU clusters over TCP
    )
}


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU process). TFLOP/s are dense data-sheet peaks; intra-node GB/s is
    the all-reduce bus bandwidth NCCL reaches between GPUs of one node; memory_gbs the HBM bandwidth."""

    name: str
    memory_gib: float
    peak_tflops: dict[str, float]  # "bf16", "fp16", "fp32", "fp8" (0: no such units)
    intra_node_gbps: float
    link: str
    network: str
    memory_gbs: float
    matmul_efficiency: float  # sustained fraction of the peak in large training GEMMs
    runtime_gib: float  # CUDA context, cuBLAS workspaces, NCCL buffers: never available to tensors
    attention_efficiency: float  # fraction of the peak attention (flash, forward + backward) sustains
    gemm_half_width: int = 0  # the hidden size per TP rank at which GEMMs reach half their large-GEMM share
    gpus_per_node: int = 8
    pcie_gbs: float = 0.0  # host <-> device copies per GPU, GB/s as pinned-memory copies reach them
    host_memory_gib: float = 0.0  # host memory of a node (what CPU offload fills)

    def with_peak(self, dtype: str, tflops: float) -> Device:
        """training.peak_tflops: what `train` divides MFU by, the peak of the training's dtype. That
        dtype's alone: fp32 GEMMs of bf16 training keep the data sheet's fp32 peak, FP8's stays too
        (refused with it: checks.check_peak)."""
        return dataclasses.replace(self, peak_tflops={**self.peak_tflops, dtype: tflops})

    def peak(self, dtype: str) -> float:
        value = self.peak_tflops.get(dtype, 0.0)
        if value <= 0:
            supported = ", ".join(k for k, v in self.peak_tflops.items() if v > 0)
            raise MeshtrainError(
                f"{self.name} has no {dtype} arithmetic: use --dtype {supported.split(', ')[0]} "
                f"(it supports {supported})"
            )
        return value


GEMM_HALF_WIDTH = 256


# Host <-> device copies of pinned memory over one GPU's PCIe x16 link, at ~75-80% of the line rate
# that cudaMemcpy bandwidth tests reach (gen3 15.8, gen4 31.5, gen5 63 GB/s per direction).
PCIE_GBS = {3: 12.0, 4: 25.0, 5: 50.0}


def _gpu(name, part, memory_gib, intra, link, network, hbm, efficiency, attention, pcie, host, bf16=True) -> Device:
    """Peaks from the one table MFU also reads (datasheets.GPU_PEAK_TFLOPS, matched by `part`); `pcie`
    the host link's PCIe generation, `host` the node's memory in GiB."""
    half, fp32, fp8 = next((b, f, e) for pattern, b, f, e in GPU_PEAK_TFLOPS if pattern == part)
    return Device(
        name,
        memory_gib,
        {"bf16": half if bf16 else 0.0, "fp16": half, "fp32": fp32, "fp8": fp8},
        intra,
        link,
        network,
        hbm,
        efficiency,
        runtime_gib=1.0,
        attention_efficiency=attention,
        gemm_half_width=GEMM_HALF_WIDTH,
        pcie_gbs=PCIE_GBS[pcie],
        host_memory_gib=host,
    )


# Memory as the driver reports it (nvidia-smi); HBM bandwidth from NVIDIA's data sheets (SXM parts);
# intra-node bus bandwidth as nccl-tests all_reduce_perf reaches on 8 GPUs of one node. Host memory
# of the usual 8-GPU node: DGX-1 (V100) 512 GiB, AWS p4d/p4de (A100) 1152, p5/p5e and DGX H100/H200/
# B200 2048 (an ABCI V node, 4 V100s, has 384: --host-memory-gib).
CATALOG = {
    d.name: d
    for d in (
        _gpu("v100-16gb", "V100", 15.78, 130.0, "NVLink 2", "ib-edr", 900.0, 0.70, 0.40, 3, 512, bf16=False),
        _gpu("v100-32gb", "V100", 31.75, 130.0, "NVLink 2", "ib-edr", 900.0, 0.70, 0.40, 3, 512, bf16=False),
        _gpu("a100-40gb", "A100", 39.39, 230.0, "NVLink 3", "ib-hdr", 1555.0, 0.75, 0.50, 4, 1152),
        _gpu("a100-80gb", "A100", 79.15, 230.0, "NVLink 3", "ib-hdr", 2039.0, 0.75, 0.50, 4, 1152),
        _gpu("h100-80gb", "H100", 79.11, 360.0, "NVLink 4", "ib-ndr", 3350.0, 0.85, 0.34, 5, 2048),
        _gpu("h200-141gb", "H200", 139.8, 360.0, "NVLink 4", "ib-ndr", 4800.0, 0.85, 0.34, 5, 2048),
        _gpu("b200-192gb", "B200", 179.1, 700.0, "NVLink 5", "ib-ndr", 8000.0, 0.85, 0.34, 5, 2048),
    )
}
KINDS = (*CATALOG, "cpu")


def cpu_device(processes_per_node: int) -> Device:
    """This machine, split into `processes_per_node` processes (each with its share of the cores):
    matmul peaks measured at that thread count (cached), memory = RAM / processes, gloo bandwidth
    over loopback as a fraction of memory bandwidth."""
    import torch

    from meshtrain.hardware import cpu_peak_tflops

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_per_node))
    try:
        fp32, bf16 = cpu_peak_tflops(torch.float32), cpu_peak_tflops(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return Device(
        "cpu",
        ram / processes_per_node,
        {"bf16": max(bf16, fp32), "fp16": 0.0, "fp32": fp32, "fp8": 0.0},  # FP8 on a CPU is emulated
        intra_node_gbps=1.0,
        link="gloo over loopback",
        network="ethernet-10g",
        memory_gbs=10.0,
        matmul_efficiency=0.8,
        runtime_gib=0.0,
        attention_efficiency=0.8,
        gpus_per_node=processes_per_node,
        host_memory_gib=ram,
    )


def device(
    kind: str,
    gpus_per_node: int | None = None,
    network: str | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    memory_gib: float | None = None,
    efficiency: float | None = None,
    comm_files: list[str] = (),
    host_memory_gib: float | None = None,
) -> tuple[Device, float]:
    """The device with the user's overrides, and the inter-node GB/s per GPU it will see."""
    if kind == "cpu":
        dev = cpu_device(gpus_per_node or 1)
    elif kind in CATALOG:
        dev = CATALOG[kind]
    else:
        raise MeshtrainError(f"--gpu {kind!r} unknown: use one of {', '.join(KINDS)}")
    net = network or dev.network
    if net not in NETWORKS:
        raise MeshtrainError(f"--network {net!r} unknown: use one of {', '.join(NETWORKS)}")
    inter = NETWORKS[net].gbps_per_gpu
    changes: dict = {"network": net}
    # Each bandwidth from one source: a second one would silently replace the first.
    given = {"intra": ["--intra-node-gbps"] if intra_node_gbps is not None else []}
    given["inter"] = [flag for flag, v in (("--network", network), ("--inter-node-gbps", inter_node_gbps)) if v]
    for path in comm_files:
        measured = read_comm(path)
        changes.update({"intra_node_gbps": measured["intra"]} if "intra" in measured else {})
        inter = measured.get("inter", inter)
        for scope in measured:
            given[scope].append(f"--comm {path}")
    for scope, sources in given.items():
        if len(sources) > 1:
            raise MeshtrainError(f"{' and '.join(sources)} both set the {scope}-node bandwidth: give one of them")
    for key, value in (
        ("gpus_per_node", gpus_per_node),
        ("intra_node_gbps", intra_node_gbps),
        ("memory_gib", memory_gib),
        ("matmul_efficiency", efficiency),
        ("host_memory_gib", host_memory_gib),
    ):
        if value is not None:
            if value <= 0:
                raise MeshtrainError(f"--{key.replace('_', '-')} must be positive, got {value}")
            changes[key] = value
    if inter_node_gbps is not None:
        if inter_node_gbps <= 0:
            raise MeshtrainError(f"--inter-node-gbps must be positive, got {inter_node_gbps}")
        inter = inter_node_gbps
    return dataclasses.replace(dev, **changes), inter


TRAINING_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what the planner's traffic is made of


def read_comm(path: str) -> dict[str, float]:
    """What `meshtrain bench comm --out FILE` measured: the best bus bandwidth of the large messages
    (>= 64 MiB, else the largest) of the collectives training runs (a broadcast's is not one of
    them), from a one-node run ("intra") or a multi-node run ("inter")."""
    try:
        rows = [r for r in json.loads(Path(path).read_text()) if r["op"] in TRAINING_COLLECTIVES]
        if not rows:
            raise MeshtrainError(f"--comm {path} measured none of {', '.join(TRAINING_COLLECTIVES)}: measure them")
        if (world := min(r["world_size"] for r in rows)) < 2:
            raise MeshtrainError(
                f"--comm {path} was measured by {world} process, which moves nothing between GPUs: run "
                "`meshtrain bench comm --nproc GPUS --out FILE` (one process per GPU)"
            )
        scope = "inter" if max(r.get("nodes", 1) for r in rows) > 1 else "intra"
        large = [r for r in rows if r["bytes"] >= 64 * 2**20] or [max(rows, key=lambda r: r["bytes"])]
        if (busbw := max(r["busbw_GBps"] for r in large)) <= 0:
            raise MeshtrainError(f"--comm {path} has no positive bus bandwidth (busbw_GBps): measure it again")
        return {scope: busbw}
    except OSError as e:
        raise MeshtrainError(
            f"--comm {path}: cannot read it ({e.strerror}); write one with `meshtrain bench comm --out FILE`"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise MeshtrainError(
            f"--comm {path} is not what `meshtrain bench comm --out` writes (a list of rows with bytes and busbw_GBps)"
        ) from None
