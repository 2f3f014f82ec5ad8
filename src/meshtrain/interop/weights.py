"""The trained weights at the end of a run: gathered from any layout into `model.safetensors` +
`model.json`, the files `meshtrain export`, `generate` and the sample read.

Gathering puts the whole model in one process's memory, so it is done only up to
run.save_model_max_gb; a larger model's weights are its last checkpoint (sharded, written by every
rank), which `meshtrain export` turns into a Hugging Face directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.files import atomic_write, write_text
from meshtrain.model import ModelArgs
from meshtrain.parallel import ParallelDims, ParallelModel


def full_state_dict(model: ParallelModel, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """The whole model's weights on global rank 0's CPU, from any layout (other ranks get {})."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.parts[0].state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dims.layout.pp == 1:
        return get_model_state_dict(model.parts[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Each stage gathers its own weights, then the stages' first replicas send them to rank 0.
    state = {}
    for part in model.parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        state.update({k: v.detach().cpu() for k, v in full.items()})
    if dims.rank_in("dp") or dims.rank_in("cp") or dims.rank_in("tp"):
        return {}
    gathered = [None] * dims.layout.pp if dist.get_rank() == 0 else None
    dist.gather_object(state, gathered, dst=0, group=dims.mesh("pp").get_group())
    return {k: v for stage in gathered for k, v in stage.items()} if gathered else {}


def model_bytes(n_params: int) -> int:
    """fp32 bytes of the full model: what gathering it costs in one process."""
    return 4 * n_params


ADAPTER_FILE, ADAPTER_RECORD = "adapter.safetensors", "adapter.json"


def save_model(state: dict[str, torch.Tensor], args: ModelArgs, run_dir: Path, peft: dict | None = None) -> Path:
    """model.safetensors + model.json (the shape), each written atomically. A LoRA run (`peft`: its
    settings and base) writes its adapters merged into the base there, so everything that reads a
    run reads it as any other, and the adapters alone beside them (adapter.safetensors + adapter.json,
    what `meshtrain export --adapter` writes out in the peft format)."""
    from safetensors.torch import save_file

    if peft is not None:
        from meshtrain.model.lora import LoraSpec, merge_state_dict

        state, adapters = merge_state_dict(state, LoraSpec.from_dict(peft))
        adapters = {k: v.contiguous() for k, v in adapters.items()}
        atomic_write(run_dir / ADAPTER_FILE, lambda tmp: save_file(adapters, str(tmp), metadata={"format": "pt"}))
        write_text(run_dir / ADAPTER_RECORD, json.dumps(peft, indent=2))
    tensors = {k: v.contiguous() for k, v in state.items() if not (args.tie_embeddings and k == "output.weight")}
    path = atomic_write(
        run_dir / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"})
    )
    write_text(run_dir / "model.json", json.dumps(dataclasses.asdict(args), indent=2))
    return path
