"""What `meshtrain plan` refuses before it searches, each in one line: a bandwidth that no link of
the planned cluster would carry, arithmetic the device lacks (or a peak that cannot stand for it),
and a pinned context-parallel degree or adapter method the trainer cannot run."""

from __future__ import annotations

from meshtrain.errors import MeshtrainError
from meshtrain.model.args import LoraSpec
from meshtrain.model.shapes import Shape
from meshtrain.plan.hardware import Device, read_comm


def check_links(o, gpus: int, gpus_per_node: int) -> None:
    """A bandwidth of a link nothing crosses would change nothing, so it is refused: between nodes
    where every GPU fits on one node, within a node where no node holds two GPUs (the speed model
    then reads only the inter-node figure). `o`: the command's options (network, inter_node_gbps,
    intra_node_gbps, comm)."""
    measured = {path: read_comm(path) for path in o.comm}
    inter = [flag for flag, value in (("--network", o.network), ("--inter-node-gbps", o.inter_node_gbps)) if value]
    inter += [f"--comm {path}" for path, scopes in measured.items() if "inter" in scopes]  # measured across nodes
    if gpus <= gpus_per_node and inter:
        raise MeshtrainError(
            f"{inter[0]} sets the bandwidth between nodes, but the {gpus} GPUs fit on one node of {gpus_per_node}: "
            "drop it, or plan more --gpus (or fewer --gpus-per-node)"
        )
    intra = ["--intra-node-gbps"] if o.intra_node_gbps else []
    intra += [f"--comm {path}" for path, scopes in measured.items() if "intra" in scopes]  # measured on one node
    if min(gpus, gpus_per_node) == 1 and intra:
        alone = "the plan has one GPU: drop it, or plan more --gpus"
        if gpus > 1:
            alone = "each node holds one GPU: drop it, or plan more --gpus-per-node"
        raise MeshtrainError(f"{intra[0]} sets the bandwidth between the GPUs of a node, but {alone}")


def check_precision(dev: Device, fp8: str, cpu_offload: bool, host_memory_gib: float | None = None) -> None:
    """FP8 on a device without FP8 units, CPU offload without a GPU, and a host memory that nothing
    would fill (no offload), refused in one line."""
    if host_memory_gib and not cpu_offload:
        raise MeshtrainError(
            f"--host-memory-gib {host_memory_gib:g} sizes the host memory that CPU offload fills: add --cpu-offload, "
            "or drop it"
        )
    if fp8 != "off" and dev.peak_tflops["fp8"] <= 0:
        raise MeshtrainError(
            f"--fp8 {fp8}: {dev.name} has no FP8 units (FP8 GEMMs need compute capability 8.9: Ada, Hopper, "
            "Blackwell); plan it without --fp8"
        )
    if cpu_offload and dev.name == "cpu":
        raise MeshtrainError("--cpu-offload moves a GPU's model states to host memory: on --gpu cpu they are there")


def check_peak(peak_tflops: float, fp8: str) -> None:
    """training.peak_tflops is what `train` divides MFU by, the peak of the training's arithmetic,
    which under training.fp8 is the FP8 peak. A plan with FP8 needs two peaks (the FP8 GEMMs', and
    bf16's for attention and the output layer): one number cannot give both, so it is refused
    rather than taken for one of them."""
    if peak_tflops and fp8 != "off":
        raise MeshtrainError(
            f"--peak-tflops (training.peak_tflops) {peak_tflops:g} with --fp8 {fp8}: train reads it as the FP8 peak "
            "MFU divides by, but the plan also needs the bf16 peak of attention and the output layer; drop it "
            "(the --gpu's data-sheet peaks) or plan without --fp8"
        )


def check_cp(shape: Shape, cp: int, tp: int, gpus: int, seq_len: int) -> None:
    """A pinned context-parallel degree that no layout can take, refused in one line: Ulysses splits
    each TP rank's query heads over the cp ranks, and each sequence into cp equal slices; and the
    world is tp x pp x cp x dp. (The trainer's other rules, key/value heads and sequence parallelism's
    slice, drop layouts in the search, which says why.)"""
    if cp == 1:
        return
    heads = shape.n_heads // tp
    if heads % cp:
        where = f"{heads} query heads per tensor-parallel rank (tp {tp})" if tp > 1 else f"{heads} query heads"
        raise MeshtrainError(
            f"--cp {cp}: context parallelism splits the attention heads over its ranks (an all-to-all), and "
            f"the model's {where} are not divisible by {cp}; use a cp that divides them"
        )
    if seq_len % cp:
        raise MeshtrainError(f"--cp {cp}: the sequence of {seq_len} tokens does not split into {cp} equal slices")
    if gpus % (cp * tp):
        raise MeshtrainError(f"--cp {cp}: {gpus} GPUs are not divisible by cp x tp = {cp * tp}")


def check_peft(peft: LoraSpec | None, arch: str, dtype: str, gpus: int, pinned: dict) -> None:
    """What meshtrain cannot train with [peft], refused in one line: adapters on a GPT shape; QLoRA
    outside bf16, or with a pinned TP, PP or FSDP (it runs on one process or plain DDP)."""
    if peft is None:
        return
    if arch != "llama":
        raise MeshtrainError(f"--peft {peft.method} plans meshtrain's adapters on its Llama: drop it with --arch gpt")
    if not peft.quantized:
        return
    if dtype != "bf16":
        raise MeshtrainError(f"--peft qlora computes in bf16 (NF4 weights dequantize to bf16): not {dtype}")
    used = [f"--{k} {v}" for k, v in pinned.items() if (k != "zero" and v > 1) or (k == "zero" and v >= 2 and gpus > 1)]
    if used:
        raise MeshtrainError(
            f"--peft qlora runs on one process or plain DDP (zero 0/1), not with {', '.join(used)} (no FSDP/TP/PP)"
        )


def check_compiled(compiled: bool, cuda_graphs: bool, llama: bool, gpu: str) -> None:
    """--compile plans meshtrain's compiled Llama blocks; --cuda-graphs replays them on a GPU."""
    if compiled and not llama:
        raise MeshtrainError("--compile plans meshtrain's compiled Llama blocks: drop it with --arch gpt")
    if cuda_graphs and not compiled:
        raise MeshtrainError("--cuda-graphs replays the compiled model's kernels: add --compile, or drop it")
    if cuda_graphs and gpu == "cpu":
        raise MeshtrainError("--cuda-graphs replays kernels on a GPU: drop it with --gpu cpu")
