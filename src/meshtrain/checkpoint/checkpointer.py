"""Saving and loading a model and its optimizer with torch.distributed.checkpoint (DCP), from and
into any layout, with asynchronous saves, a free-space check and pruning of old checkpoints."""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.checkpoint.commit import (
    MARKER,
    STEP_DIR,
    TRAIN_STATE,
    committed_checkpoints,
    crc32,
    read_train_state,
    retire,
)
from meshtrain.errors import CheckpointError
from meshtrain.files import FIXES, ensure_room, os_error_in, write_json
from meshtrain.lock import job_token
from meshtrain.logs import log
from meshtrain.optim import local_optimizer

# One process saves and loads without a process group on purpose; DCP warns about it every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def merge_parts(parts: list[nn.Module]) -> nn.Module:
    """One module over several pipeline stages of this rank, with the full model's parameter names
    (layers.{i}, tok_embeddings, ...), so that the state dict does not depend on the split."""
    if len(parts) == 1:
        return parts[0]
    merged = nn.Module()
    merged.layers = nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():
            if name == "layers":
                merged.layers.update(child)
            elif child is not None:
                setattr(merged, name, child)
    return merged


def dcp():
    """torch.distributed.checkpoint, loaded at a run's first save or load, not at its start: it brings
    DTensor with it (meshtrain/dtensor.py)."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict

    return torch.distributed.checkpoint


class Checkpointer:
    def __init__(
        self,
        root: Path,
        model_parts: list[nn.Module],
        optimizer,
        keep: int,
        use_async: bool,
        rank: int,
        group_timeout: timedelta = timedelta(minutes=10),
    ):
        """`group_timeout`: how long a rank waits at a checkpoint's collectives for the slowest save or
        load (train/watchdog.py's checkpoint_group_timeout: the watchdog ends one that stops moving)."""
        self.root, self.keep, self.rank = root, keep, rank
        self.model = merge_parts(model_parts)
        # ZeroRedundancyOptimizer: each rank saves/loads the states of its own parameters.
        self.optimizer = local_optimizer(optimizer)
        # A group of the checkpoints' own: async saves run collectives in the background (on the training
        # group they would interleave with training's and crash or hang), and a slow file system is
        # waited for beyond the training group's timeout.
        self.group = dist.new_group(backend="gloo", timeout=group_timeout) if dist.is_initialized() else None
        self.use_async = use_async
        self.pending = None
        self.writing: Path | None = None  # the step directory a save in flight writes
        # LoRA: the frozen base is not saved (it is the model the run started from); the adapters are.
        frozen = any(not p.requires_grad for p in self.model.parameters())
        self.options = dcp().state_dict.StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None

    def _state(self) -> dict:
        model_sd, optim_sd = dcp().state_dict.get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, step: int, train_state: dict, blocking: bool = False) -> None:
        self.wait()
        path = self.root / f"step_{step:08d}"
        # This step, committed: a finished run started again. Every rank reads the same marker on the
        # shared checkpoint directory (no collective: the first one of a save stays DCP's own).
        if (path / MARKER).is_file():
            log.info(f"{path} already holds step {step}: kept as it is")
            return
        self._check_space(step)
        if self.rank == 0 and path.exists():
            retire(path)  # an uncommitted leftover of the same step: deleted if it holds only a save's files
        if dist.is_initialized():
            dist.barrier(group=self.group)
        write_json(path / f"rng-rank{self.rank:05d}.json", rng_state())  # each rank's own generators
        self.writing = path
        state = self._state()
        with self._saving(step, path):
            if self.use_async and not blocking:
                future = dcp().async_save(state, checkpoint_id=str(path), process_group=self.group)
                self.pending = (future, step, path, train_state)
            else:
                dcp().save(state, checkpoint_id=str(path), process_group=self.group)
        if self.pending is None:
            self._commit(step, path, train_state)

    def written_bytes(self) -> int:
        """The bytes this rank's shards of the save in flight hold so far (the watchdog's sign that a
        slow save progresses)."""
        total, path = 0, self.writing
        with contextlib.suppress(OSError):
            for shard in path.glob(f"__{self.rank}_*.distcp") if path is not None else ():
                total += shard.stat().st_size
        return total

    def wait(self) -> None:
        """Finish and commit an async save in flight."""
        if self.pending is not None:
            future, step, path, train_state = self.pending
            self.pending = None
            with self._saving(step, path):
                future.result()
            self._commit(step, path, train_state)

    def _check_space(self, step: int) -> None:
        """Refuse, before writing anything, a checkpoint the file system has no room for (every rank
        adds up its model and optimizer bytes: the same total and the same answer everywhere)."""
        from meshtrain.parallel.memory import model_state_bytes

        local = model_state_bytes(list(self.model.parameters()), self.optimizer)
        need = torch.tensor([float(local["params"] + local["optimizer"])])
        if dist.is_initialized():
            dist.all_reduce(need, group=self.group)
        ensure_room(self.root, need.item(), f"the checkpoint of step {step} (earlier checkpoints are intact)")

    @contextlib.contextmanager
    def _saving(self, step: int, path: Path):
        """A failed save (disk full, read-only, quota) as one line naming the cause; earlier checkpoints stay."""
        try:
            yield
        except Exception as e:
            cause = os_error_in(e)
            fix = FIXES.get(getattr(cause, "errno", None), "check the file system")
            raise CheckpointError(
                f"saving the checkpoint of step {step} to {path} failed: "
                f"{getattr(cause, 'strerror', None) or cause} ({fix}); earlier checkpoints are "
                "intact"
            ) from None

    def _commit(self, step: int, path: Path, train_state: dict) -> None:
        # Each rank checksums the shards it has just written (still in the page cache), in parallel.
        mine = {p.name: crc32(p) for p in path.glob(f"__{self.rank}_*.distcp")}
        sums = [mine]
        if dist.is_initialized():
            sums = [None] * dist.get_world_size()
            dist.all_gather_object(sums, mine, group=self.group)  # also: every rank has written its shards
        if self.rank == 0:
            write_json(path / TRAIN_STATE, train_state)
            known = {name: crc for rank_sums in sums for name, crc in rank_sums.items()}
            files = {
                p.name: {"bytes": p.stat().st_size, "crc32": known.get(p.name) or crc32(p)}
                for p in sorted(path.iterdir())
                if p.is_file() and p.name != MARKER
            }
            marker = {"step": step, "layout": train_state.get("layout"), "job": job_token(), "files": files}
            write_json(path / MARKER, marker)
            self._prune()
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def _prune(self) -> None:
        committed = committed_checkpoints(self.root)
        for old in committed[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        if committed:  # interrupted saves older than the newest commit are garbage
            newest = int(STEP_DIR.match(committed[-1].name).group(1))
            for p in self.root.iterdir():
                m = STEP_DIR.match(p.name)
                if m and int(m.group(1)) < newest and not (p / MARKER).is_file():
                    retire(p)  # deleted when it holds only what a save writes

    def load(self, path: Path, model_shape: dict) -> dict:
        """Load model and optimizer into the current layout; returns the train state."""
        train_state = read_train_state(path)
        saved_shape = train_state.get("model")
        model_shape = json.loads(json.dumps(model_shape))  # as train_state.json holds it (tuples as lists)
        if saved_shape is not None and saved_shape != model_shape:
            diff = ", ".join(
                f"{k} {saved_shape.get(k)} -> {v}" for k, v in model_shape.items() if saved_shape.get(k) != v
            )
            raise CheckpointError(
                f"checkpoint {path} holds a different model ({diff}); use a matching "
                "model config or checkpoint.resume = none"
            )
        state = self._state()
        own_groups = [list(group["params"]) for group in state["optim"].get("param_groups", [])]
        restore_tied = _load_tied_copy_from_embedding(state, path)
        try:
            dcp().load(state, checkpoint_id=str(path), process_group=self.group)
        except (Exception, dcp().api.CheckpointException) as e:  # (a BaseException) wraps each rank's failure
            cause = next(iter(e.failures.values()))[0] if isinstance(e, dcp().api.CheckpointException) else e
            line = str(cause).strip().splitlines()[0]
            if line.startswith("Missing key"):  # it does not hold what this job's model or optimizer has
                line += (
                    " (saved by another model, or by a meshtrain that grouped the optimizer's parameters otherwise:"
                    " start without it, checkpoint.resume = none)"
                )
            raise CheckpointError(f"checkpoint {path} could not be loaded into this job: {line}") from None
        restore_tied()
        loaded_groups = state["optim"].get("param_groups", [])
        if len(loaded_groups) == len(own_groups):
            # A pipeline's checkpoint holds one stage's parameter names; this optimizer's own names
            # map the states (a tied matrix, one parameter with two names, is found by them only).
            for group, names in zip(loaded_groups, own_groups):
                group["params"] = names
        # Hyperparameters come from the config (and the LR from the schedule's state), not the
        # checkpoint: DCP does not always bring back a pipeline stage's param-group options.
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        dcp().state_dict.set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.options,
        )
        for group, options in zip(self.optimizer.param_groups, hyper):
            group.update(options)
        self._load_rng(path, train_state)
        return train_state

    def _load_rng(self, path: Path, train_state: dict) -> None:
        """This rank's generators as this rank saved them (dropout and sampling differ by rank). On
        another world size ranks are different processes: they keep their fresh seeds."""
        saved_world = (train_state.get("layout") or {}).get("world_size")
        world = dist.get_world_size() if dist.is_initialized() else 1
        own = path / f"rng-rank{self.rank:05d}.json"
        if saved_world == world and own.is_file():
            set_rng_state(json.loads(own.read_text()))
        elif self.rank == 0:
            log.info(f"random generators not restored: {path} was saved by {saved_world} ranks, this run has {world}")


def _load_tied_copy_from_embedding(state: dict, path: Path):
    """Tied embeddings saved without a pipeline have one optimizer state, the embedding's; a
    pipeline's last stage keeps a copy of the matrix as output.weight, whose state is loaded from
    the embedding's. Renames the copy's entry before the load; returns what puts it back after."""
    optim_state = state["optim"].get("state", {})
    if "output.weight" not in optim_state:
        return lambda: None
    saved = dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if any(key.startswith("optim.state.output.weight.") for key in saved):
        return lambda: None
    copy = optim_state.pop("output.weight")
    if "tok_embeddings.weight" in optim_state:  # this rank holds both stages (zbv): one load, two states

        def restore() -> None:
            for name, value in optim_state["tok_embeddings.weight"].items():
                copy[name] = value.clone() if isinstance(value, torch.Tensor) else value
            optim_state["output.weight"] = copy

        return restore
    optim_state["tok_embeddings.weight"] = copy

    def rename_back() -> None:
        optim_state["output.weight"] = optim_state.pop("tok_embeddings.weight")

    return rename_back


def rng_state() -> dict:
    """The CPU generator and, on a GPU, this device's generator."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
