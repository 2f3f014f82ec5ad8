"""The trained weights at the end of a run: gathered from any layout into `model.safetensors` +
`model.json`, the files `meshtrain export`, `generate` and the sample read.

Gathering puts the whole model in one process's memory, so it is done only up to
run.save_model_max_gb; a larger model's weights are its last checkpoint (sharded, written by every
rank), which `meshtrain export` turns into a Hugging Face directory. Which of a run's weights (the
final ones or its newest checkpoint) export, serve and generate read is decided here too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.checkpoint import (
    MARKER,
    TRAIN_STATE,
    committed_checkpoints,
    read_train_state,
    run_checkpoint_root,
    verify,
)
from meshtrain.errors import CheckpointError, MeshtrainError
from meshtrain.files import atomic_write, read_json_object, write_text
from meshtrain.model import ModelArgs
from meshtrain.model.args import model_record_problem
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


def save_model(
    state: dict[str, torch.Tensor], args: ModelArgs, run_dir: Path, peft: dict | None = None, step: int | None = None
) -> tuple[Path, dict[str, torch.Tensor]]:
    """model.safetensors + model.json (the shape), each written atomically; returns the path and the
    weights written. A LoRA run (`peft`: its settings and base) writes its adapters alone first
    (adapter.safetensors + adapter.json, what `meshtrain export --adapter` writes out in the peft
    format), then the model with them merged into the base as read again from where the run started
    (interop/base.py: merged_onto_base), so everything that reads a run reads it as any other. The
    training `step` goes in the safetensors metadata: export, serve and generate take these weights
    or the run's newest checkpoint by it (model.json is read back as ModelArgs, which has no room for it)."""
    from safetensors.torch import save_file

    if peft is not None:
        from meshtrain.interop.base import merged_onto_base
        from meshtrain.model.lora import ADAPTER_NAMES

        adapters = {k: v.contiguous() for k, v in state.items() if k.endswith(ADAPTER_NAMES)}
        atomic_write(run_dir / ADAPTER_FILE, lambda tmp: save_file(adapters, str(tmp), metadata={"format": "pt"}))
        write_text(run_dir / ADAPTER_RECORD, json.dumps(peft, indent=2))
        state = merged_onto_base(state, args, peft)
    tensors = {k: v.contiguous() for k, v in state.items() if not (args.tie_embeddings and k == "output.weight")}
    metadata = {"format": "pt"} | ({"step": str(step)} if step is not None else {})
    path = atomic_write(run_dir / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    write_text(run_dir / "model.json", json.dumps(dataclasses.asdict(args), indent=2))
    return path, state


def run_weights(source: Path) -> tuple[Path | None, Path]:
    """(checkpoint dir or None for the run's model.safetensors, run dir). Of a run's newest committed
    checkpoint (in its checkpoint.dir) and its model.safetensors, the later training step wins: with
    checkpoint.every = 0 a run stopped at step N (preempted, training.time_limit,
    training.stop_at_step) and resumed to the end keeps the checkpoint of step N beside the final
    weights. A checkpoint is verified against its commit marker before anything reads it."""
    if (source / MARKER).is_file() or (source / ".metadata").is_file():
        verify(source)
        return source, run_of(source)
    newest = next(reversed(committed_checkpoints(checkpoints_of(source))), None)
    final = source / "model.safetensors"
    if newest is not None and final.is_file() and _final_is_newer(final, newest):
        return None, source
    if newest is not None:
        verify(newest)
        return newest, source
    if final.is_file() and (source / "model.json").is_file():
        return None, source
    if final.is_file() and not (source / "config.json").is_file():
        raise CheckpointError(
            f"{source / 'model.json'} is missing beside model.safetensors: the weights have no recorded shape; "
            "restore it from the run, or export one of its checkpoints"
        )
    if (source / "config.json").is_file():
        raise MeshtrainError(
            f"{source} is a Hugging Face directory: export takes a meshtrain run or checkpoint (train from it with "
            f"model.init_from = 'hf:{source}', or serve it as it is)"
        )
    raise MeshtrainError(
        f"{source} holds neither a committed checkpoint nor model.safetensors: pass a run "
        "directory or a checkpoints/step_N directory"
    )


def checkpoints_of(run: Path) -> Path:
    """Where a run directory's checkpoints are: the checkpoint.dir its config.toml records, else
    <run>/checkpoints (also for a relative checkpoint.dir the moved run directory no longer places, or
    one that is gone: the final weights, or the default place, are what is left to read)."""
    try:
        root = run_checkpoint_root(run)
    except CheckpointError:
        return run / "checkpoints"
    return root if root.is_dir() else run / "checkpoints"


def run_of(ckpt: Path) -> Path:
    """The run directory that wrote a checkpoint, where its tokenizer and record are: the one holding
    it (<run>/checkpoints/step_N, even moved or copied), else the one its train_state.json names
    (checkpoint.dir outside run.dir), each only if its checkpoints are where the checkpoint is: a
    stale recorded path may now hold another run."""
    recorded = read_json_object(ckpt / TRAIN_STATE).get("run_dir")
    holder = ckpt.parent.parent
    candidates = [holder, *([Path(recorded)] if recorded else [])]
    where = ckpt.resolve().parent
    for run in candidates:
        if (run / "config.toml").is_file() and checkpoints_of(run).resolve() == where:
            return run
    if (holder / "config.toml").is_file():  # a record that cannot place its checkpoints: where it lies
        return holder
    raise MeshtrainError(
        f"no run directory found for checkpoint {ckpt} (none of {', '.join(map(str, candidates))} holds a config.toml "
        "whose checkpoints are there): pass the run directory that wrote it instead"
    )


def _final_is_newer(final: Path, ckpt: Path) -> bool:
    """Whether model.safetensors holds a later step than the checkpoint (a tie: the same weights, the
    checkpoint as before). Its step is in its metadata; a file written before meshtrain recorded it
    is compared by modification time with the checkpoint's commit, and the choice is logged."""
    from safetensors import safe_open

    from meshtrain.logs import log

    try:
        with safe_open(final, "pt") as f:
            step = (f.metadata() or {}).get("step")
    except Exception as e:  # safetensors' own error type: a truncated or overwritten file
        raise damaged_weights(final, e) from None
    if step is not None:
        return int(step) > json.loads((ckpt / MARKER).read_text())["step"]
    newer = final.stat().st_mtime > (ckpt / MARKER).stat().st_mtime
    chosen, other = (final, ckpt) if newer else (ckpt, final)
    log.warning(f"{final} records no training step: using {chosen}, written after {other}")
    return newer


def peft_record_of(ckpt: Path | None, run_dir: Path) -> dict | None:
    """A LoRA run's adapter settings and base (None: trained without adapters)."""
    if ckpt is not None:
        return read_train_state(ckpt).get("peft")
    return json.loads(record.read_text()) if (record := run_dir / ADAPTER_RECORD).is_file() else None


def damaged_weights(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} cannot be read ({str(error).splitlines()[0] if str(error) else type(error).__name__}): it is "
        "truncated or not a safetensors file; export one of the run's checkpoints instead (RUN/checkpoints/step_N)"
    )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A run's safetensors file (model.safetensors, its adapters), or one line saying it is damaged."""
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:  # safetensors' own error type
        raise damaged_weights(path, e) from None


def run_model_args(path: Path) -> ModelArgs:
    """The shape a run recorded in model.json, or one line saying the file is not one meshtrain wrote."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the run's weights have no recorded shape; restore it from the run")
    try:
        record = read_json_object(path)
    except MeshtrainError as e:
        raise CheckpointError(f"{path} is not a model.json meshtrain wrote ({e}): restore it from the run") from None
    if problem := model_record_problem(record):
        raise CheckpointError(f"{path} is not a model.json meshtrain wrote ({problem}): restore it from the run")
    return ModelArgs(**record)
