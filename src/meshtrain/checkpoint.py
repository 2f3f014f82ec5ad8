"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, commit, resume, reshard, prune.

A checkpoint is a directory `<checkpoint.dir>/step_00000006/`:
  .metadata, __<rank>_0.distcp   DCP: model and optimizer, keyed by parameter name (so any layout
                                 can load what any other layout saved)
  train_state.json               step, data-loader position, LR schedule, RNG, layout, model shape
                                 (LoRA: the adapters' settings and the base they belong to; only
                                 the adapters are in the shards)
  COMMITTED.json                 written last, once every rank has finished: step, layout, the size
                                 and CRC-32 of every file (each rank checksums the shards it wrote)
A directory without COMMITTED.json is an interrupted save, and one whose files no longer match their
checksums is damaged: `resume = "auto"` skips either with a warning and takes the previous one.
Older checkpoints are deleted only after a newer one has committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from meshtrain.errors import CheckpointError
from meshtrain.files import FIXES, ensure_room, os_error_in, write_json
from meshtrain.launch.distributed import agreed
from meshtrain.lock import JobLocks, job_token
from meshtrain.logs import log
from meshtrain.optim import local_optimizer

# One process saves and loads without a process group on purpose; DCP warns about it every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MARKER = "COMMITTED.json"
TRAIN_STATE = "train_state.json"
STEP_DIR = re.compile(r"step_(\d+)$")


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


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> dict:
    """The commit marker of a complete, unchanged checkpoint, or a CheckpointError naming what is
    wrong. `share` = (k, n) checksums every n-th file from the k-th: n ranks verify one
    checkpoint together, each reading 1/n of its bytes."""
    marker_path = path / MARKER
    if not marker_path.is_file():
        raise CheckpointError(f"checkpoint {path} was never committed (no {MARKER}): an interrupted save")
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
    except (ValueError, KeyError):
        raise CheckpointError(f"{marker_path} is corrupt; resume from an earlier checkpoint") from None
    k, n = share
    for name, expected in sorted(files.items())[k::n]:
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}: a shard was lost; resume from an earlier one")
        if f.stat().st_size != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} is {f.stat().st_size} bytes, expected {expected['bytes']} "
                "(truncated or overwritten); resume from an earlier one"
            )
        if crc32(f) != expected["crc32"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} does not match its checksum in {MARKER} (its bytes "
                "changed after the save); resume from an earlier one"
            )
    return marker


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories (committed or not), oldest first."""
    if not root.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
    return [p for _, p in steps]


def committed_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first."""
    return [p for p in step_dirs(root) if (p / MARKER).is_file()]


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _agreed_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint, verified by all ranks together (each a share of its files);
    every rank gets the same answer."""
    try:
        verify(path, _rank_world())
        problem = None
    except CheckpointError as e:
        problem = str(e)
    if not dist.is_initialized():
        return problem
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


SAVE_FILES = re.compile(r"(\.metadata|__\d+_\d+\.distcp|rng-rank\d+\.json|train_state\.json|\..*\.tmp-\d+)$")


def retire(path: Path) -> None:
    """Take a checkpoint out of the run's lineage: an interrupted save (a directory holding only
    files a save writes) is deleted; a damaged one, or anything else, is renamed damaged_step_N
    (kept to inspect, never resumed). A start that skips a checkpoint then logs over its steps:
    were it resumed later (a repaired file, a save that completes late), the metrics of the steps
    in between would be gone."""
    ours = all(SAVE_FILES.fullmatch(f.name) and f.is_file() for f in path.iterdir())
    if not (path / MARKER).is_file() and ours:
        shutil.rmtree(path, ignore_errors=True)
        return
    target, n = path.with_name(f"damaged_{path.name}"), 1
    while target.exists():
        target, n = path.with_name(f"damaged_{path.name}.{n}"), n + 1
    path.rename(target)


def checkpoint_root(cfg) -> Path:
    """checkpoint.dir, by default <run.dir>/checkpoints."""
    return Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints")


# Set where a job comes back: torch elastic's workers restarted (`--max-restarts`), a Slurm job requeued.
RESTART_COUNTERS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def job_came_back() -> bool:
    """Whether this start is the job coming back (its workers restarted, the job requeued): an SGE
    job rerun says so with RESTARTED=1 beside its JOB_ID."""
    counts = [os.environ.get(name, "0") for name in RESTART_COUNTERS]
    sge_rerun = bool(os.environ.get("JOB_ID")) and os.environ.get("RESTARTED") == "1"
    return sge_rerun or any(count.isdigit() and int(count) > 0 for count in counts)


def saved_by_this_job(path: Path) -> bool:
    """Whether this job (its scheduler's job id, or the token its launcher passes down) committed the
    checkpoint: what tells its own saves from an earlier run's in the same checkpoint.dir."""
    try:
        return json.loads((path / MARKER).read_text()).get("job") == job_token()
    except (OSError, ValueError, AttributeError):
        return False


def continue_job(cfg):
    """The config this start of the job trains with. checkpoint.resume = PATH (or none) says where
    the job starts; taken again when the job comes back, it would redo every step since (and prune
    the newer checkpoints), or refuse them as another run's. A job that came back continues from the
    newest checkpoint it committed itself instead, and says so. Checkpoints of another job (a start
    refused and restarted, a later step of a requeued allocation) leave the setting as given, and its
    refusals stand. Every rank decides the same: the job's token and its own marker files."""
    import dataclasses

    root = checkpoint_root(cfg)
    if cfg.checkpoint.resume == "auto" or not job_came_back():
        return cfg
    own = [path for path in committed_checkpoints(root) if saved_by_this_job(path)]
    if not own:
        return cfg
    log.info(
        f"this job came back (a restart or requeue): continuing from the newest checkpoint it committed "
        f"({own[-1].name}, or an older one of its own if that is damaged), not checkpoint.resume = "
        f"{cfg.checkpoint.resume}, where it started"
    )
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))


def run_checkpoint_root(run_dir: Path) -> Path:
    """Where a run directory's checkpoints are: the checkpoint.dir its config.toml records (it may lie
    outside run.dir), else <run>/checkpoints. A relative checkpoint.dir is relative to the directory
    training ran in, which the relative run.dir recorded beside it tells."""
    import tomllib

    path = run_dir / "config.toml"
    try:
        recorded = tomllib.loads(path.read_text()) if path.is_file() else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid TOML ({e}): restore the run's config") from None
    directory = recorded.get("checkpoint", {}).get("dir")
    if not directory or Path(directory).is_absolute():
        return Path(directory or run_dir / "checkpoints")
    started, here = Path(recorded.get("run", {}).get("dir", "")), Path(os.path.abspath(run_dir)).parts
    cwd = here[: len(here) - len(started.parts)]
    if started.is_absolute() or ".." in started.parts or cwd + started.parts != here:
        raise CheckpointError(
            f"{path}: checkpoint.dir = {directory!r} is relative to the directory training ran in, which its run.dir "
            "does not tell: pass the checkpoint itself"
        )
    return Path(*cwd, directory)


def newest_checkpoint(path: Path) -> Path:
    """What checkpoint.resume = PATH starts from: a checkpoint itself, else the newest committed one of a
    checkpoint root, or of a run directory (in its checkpoint.dir)."""
    if (path / MARKER).is_file():
        return path
    if committed := committed_checkpoints(path) or committed_checkpoints(root := run_checkpoint_root(path)):
        return committed[-1]
    if (path / "config.toml").is_file():
        raise CheckpointError(
            f"checkpoint.resume = {path}: that run directory has no committed checkpoint (none in {root}); name a "
            "checkpoint, or set checkpoint.resume = none"
        )
    return path


def job_locks(cfg) -> JobLocks:
    """The locks a run takes: run.dir's, and checkpoint.dir's where it lies outside run.dir."""
    root, run_dir = checkpoint_root(cfg).resolve(), Path(cfg.run.dir).resolve()
    inside = root == run_dir or run_dir in root.parents
    return JobLocks(cfg.run.dir, None if inside else root)


def refuse_another_lineage(resume: str, root: Path) -> None:
    """A fresh start (resume = "none") where another run's checkpoints are: its first save would be
    pruned at once as the oldest, and the next start would resume the other run. Refused before
    anything is written."""
    committed = committed_checkpoints(root)
    if resume == "none" and committed:
        raise CheckpointError(
            f"checkpoint.resume = none, but {root} holds checkpoints of an earlier run (newest {committed[-1].name}): "
            "use a new run.dir (or checkpoint.dir), move them away, or continue them with checkpoint.resume = auto"
        )


def refuse_overwriting_results(resume: str, root: Path, run_dir: Path) -> None:
    """Refused before anything is written: a start from an explicit checkpoint older than the newest
    in `root` (its saves would replace the newer ones as it passes their steps, and pruning would mix
    the two lineages); and a start that continues none of `root`'s checkpoints in a run.dir holding an
    earlier run's trained weights (it would replace them). A run that crashed before its first
    checkpoint left only metrics: starting it again is how it is recovered. Not called for the same
    job coming back (it holds the run directory's lock): that is the run itself, restarted."""
    committed = committed_checkpoints(root)
    start = None if resume in ("auto", "none") else newest_checkpoint(Path(resume))
    if start is not None and (m := STEP_DIR.match(start.name)):
        newer = [p for p in committed if int(STEP_DIR.match(p.name).group(1)) > int(m.group(1))]
        if newer:
            raise CheckpointError(
                f"checkpoint.resume = {resume} continues from step {int(m.group(1))}, but {root} holds newer "
                f"checkpoints ({', '.join(p.name for p in newer)}) this run would replace: move them away, resume "
                "the newest (checkpoint.resume = auto), or save elsewhere (checkpoint.dir)"
            )
    default_root = run_dir / "checkpoints"
    if resume == "auto" and not committed and root.resolve() != default_root.resolve():
        if elsewhere := committed_checkpoints(default_root):  # checkpoint.dir moved: a fresh start here
            raise CheckpointError(
                f"checkpoint.dir is {root}, but {default_root} holds this run.dir's checkpoints (newest "
                f"{elsewhere[-1].name}), which this start would not continue: set checkpoint.dir back, or "
                f"continue them with checkpoint.resume = {elsewhere[-1]}"
            )
    own = [p.resolve() for p in committed]
    continuing = (resume == "auto" and committed) or (start is not None and start.resolve() in own)
    if start is not None and not continuing and committed:  # another run's checkpoint into this root
        raise CheckpointError(
            f"checkpoint.resume = {resume} is not one of {root}'s checkpoints, which hold an earlier run (newest "
            f"{committed[-1].name}): this run's saves would mix with them and pruning would delete them; save "
            "elsewhere (a new run.dir or checkpoint.dir), or move them away"
        )
    if not continuing and (run_dir / "model.safetensors").is_file():
        raise CheckpointError(
            f"run.dir {run_dir} holds an earlier run's trained weights (model.safetensors) and no checkpoint of it "
            "to continue: use a new run.dir, or move them away (runs with checkpoint.every > 0 can be continued)"
        )


def find_resume(resume: str, root: Path, warn, retire_skipped: bool = False) -> Path | None:
    """The checkpoint to resume from: for "auto" the newest complete one (newer uncommitted or
    damaged ones are skipped with a warning, and with retire_skipped taken out of the lineage), for
    a path that checkpoint (it must be complete). Under a process group all ranks decide together:
    rank 0 lists the candidates, every rank checksums a share of each, all get the same answer."""
    if resume == "none":
        return None
    rank = _rank_world()[0]
    if resume != "auto":
        path = agreed(newest_checkpoint(Path(resume)))
        problem = _agreed_problem(path)
        if problem:
            raise CheckpointError(problem)
        return path
    chosen = None
    for path in agreed(step_dirs(root)[::-1]):
        problem = _agreed_problem(path)
        if problem is None:
            chosen = path
            break
        if rank == 0:
            uncommitted = "never committed" in problem
            warn(
                f"skipping uncommitted checkpoint {path} (an interrupted save)"
                if uncommitted
                else f"skipping damaged checkpoint: {problem}"
            )
            if retire_skipped:
                retire(path)
    if retire_skipped and dist.is_initialized():
        dist.barrier()  # retired everywhere before anyone writes
    return chosen


class Checkpointer:
    def __init__(self, root: Path, model_parts: list[nn.Module], optimizer, keep: int, use_async: bool, rank: int):
        self.root, self.keep, self.rank = root, keep, rank
        self.model = merge_parts(model_parts)
        # ZeroRedundancyOptimizer: each rank saves/loads the states of its own parameters.
        self.optimizer = local_optimizer(optimizer)
        # Async saves run collectives in the background: on the training group they would interleave
        # with training's and crash or hang, so they get a group of their own.
        self.async_group = dist.new_group(backend="gloo") if use_async and dist.is_initialized() else None
        self.use_async = use_async
        self.pending = None
        # LoRA: the frozen base is not saved (it is the model the run started from); the adapters are.
        frozen = any(not p.requires_grad for p in self.model.parameters())
        self.options = StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
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
            dist.barrier()
        write_json(path / f"rng-rank{self.rank:05d}.json", rng_state())  # each rank's own generators
        state = self._state()
        with self._saving(step, path):
            if self.use_async and not blocking:
                kwargs = {"process_group": self.async_group} if self.async_group is not None else {}
                self.pending = (dcp.async_save(state, checkpoint_id=str(path), **kwargs), step, path, train_state)
            else:
                dcp.save(state, checkpoint_id=str(path))
        if self.pending is None:
            self._commit(step, path, train_state)

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
            dist.all_reduce(need)
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
            dist.all_gather_object(sums, mine)  # also: every rank has written its shards
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
            dist.barrier()

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
        train_state = json.loads((path / TRAIN_STATE).read_text())
        saved_shape = train_state.get("model")
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
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # DCP wraps per-rank failures; keep the first line of the cause
            raise CheckpointError(f"checkpoint {path} could not be loaded: {str(e).strip().splitlines()[0]}") from None
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
        set_state_dict(
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
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
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
