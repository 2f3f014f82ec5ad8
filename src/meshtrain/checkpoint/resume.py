"""Where a start resumes from: checkpoint.resume (auto, none, a path, a run directory), a job that
came back after a restart or requeue, and the refusals that keep two runs' checkpoints apart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from meshtrain.checkpoint.commit import (
    MARKER,
    STEP_DIR,
    agreed_problem,
    committed_checkpoints,
    rank_world,
    retire,
    step_dirs,
)
from meshtrain.errors import CheckpointError
from meshtrain.launch.distributed import agreed
from meshtrain.lock import JobLocks, job_token
from meshtrain.logs import log


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


def find_resume(
    resume: str, root: Path, warn, retire_skipped: bool = False, results: Path | None = None
) -> Path | None:
    """The checkpoint to resume from: for "auto" the newest complete one (newer uncommitted or
    damaged ones are skipped with a warning, and with retire_skipped taken out of the lineage), for
    a path that checkpoint (it must be complete). Under a process group all ranks decide together:
    rank 0 lists the candidates, every rank checksums a share of each, all get the same answer.
    `results`: the run's trained weights; where every checkpoint was skipped and they exist, the fresh
    start that follows would replace them: refused, before anything is retired."""
    if resume == "none":
        return None
    rank = rank_world()[0]
    if resume != "auto":
        path = agreed(newest_checkpoint(Path(resume)))
        problem = agreed_problem(path)
        if problem:
            raise CheckpointError(problem)
        return path
    chosen, skipped = None, []
    for path in agreed(step_dirs(root)[::-1]):
        problem = agreed_problem(path)
        if problem is None:
            chosen = path
            break
        skipped.append((path, problem))
    if chosen is None and skipped and results is not None and agreed(results.is_file()):
        raise CheckpointError(
            f"no checkpoint of {root} can be resumed ({skipped[0][1]}), and {results} holds the run's trained "
            "weights, which a fresh start would replace: repair or move the checkpoints, or use a new run.dir"
        )
    for path, problem in skipped:
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
