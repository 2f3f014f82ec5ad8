"""What makes a checkpoint complete: its commit marker and checksums, and what takes an interrupted
or damaged one out of a run's lineage."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import torch.distributed as dist

from meshtrain.errors import CheckpointError
from meshtrain.fields import first_problem, number, numbers, whole

MARKER = "COMMITTED.json"
TRAIN_STATE = "train_state.json"
STEP_DIR = re.compile(r"step_(\d+)$")


def read_train_state(path: Path) -> dict:
    """A checkpoint's train_state.json with every field checked for its type and bounds, or one line
    naming the field: its checksum in the marker guards against damage, this against a writer that
    was wrong (a hand edit with the checksum updated, another tool, a newer meshtrain)."""
    where = path / TRAIN_STATE
    try:
        state = json.loads(where.read_text())
        problem = _train_state_problem(state) if isinstance(state, dict) else "not a JSON object"
    except (OSError, ValueError) as e:
        problem = str(e).splitlines()[0]
    if problem:
        raise CheckpointError(
            f"{where} is corrupt ({problem}); resume from another checkpoint (checkpoint.resume = <its path>) "
            "or start afresh (checkpoint.resume = none)"
        )
    return state


_LOADER = {
    "consumed": whole,
    "seed": whole,  # training.seed: 0 or more
    "seq_len": lambda v: whole(v, 1),
    "n_windows": lambda v: whole(v, 1) or (isinstance(v, list) and v != [] and all(whole(n, 1) for n in v)),
    "weights": lambda v: numbers(v) and v != [] and all(w > 0 for w in v),
    "taken": lambda v: isinstance(v, list) and all(whole(n) for n in v),
    "content_ids": lambda v: isinstance(v, list) and all(i is None or isinstance(i, str) for i in v),
}
_SCHEDULER = {  # torch's LambdaLR keys this meshtrain checks; others are torch's to read
    "base_lrs": numbers,
    "_last_lr": numbers,
    "last_epoch": whole,
    "_step_count": whole,
    "schedule": lambda v: (
        isinstance(v, dict)  # optim.SCHEDULE_KEYS: the LR shape it was saved with
        and set(v) <= {"warmup_steps", "min_lr_ratio", "steps"}
        and whole(v.get("warmup_steps", 0))
        and whole(v.get("steps", 1), 1)
        and numbers([v.get("min_lr_ratio", 0.0)])
        and v.get("min_lr_ratio", 0.0) <= 1
    ),
}
_LOSS_SCALE = {
    "scale": lambda v: number(v, 0, 2.0**127, above=True),  # a float32 (the scaler's tensor)
    "growth_factor": lambda v: number(v, 1, 1e3),
    "backoff_factor": lambda v: number(v, 0, 1, above=True),
    "growth_interval": lambda v: whole(v, 1),
    "_growth_tracker": whole,
}
_BASE = {  # the model a LoRA run's adapters or a DPO run's reference belong to (interop/base.py)
    "seed": whole,
    "init_from": lambda v: isinstance(v, str) and v != "",
    "config_sha256": lambda v: isinstance(v, str),
    "weights_sha256": lambda v: isinstance(v, str),
}
_PEFT = {
    "method": lambda v: v in ("lora", "qlora"),
    "rank": lambda v: whole(v, 1),
    "alpha": lambda v: number(v, above=True),
    "dropout": lambda v: number(v, 0, 1) and v < 1,
    "targets": lambda v: isinstance(v, list) and v != [] and all(isinstance(t, str) for t in v),
    "base": lambda v: isinstance(v, dict),
    "base_storage": lambda v: v in ("bf16", "fp16", "fp32"),
}
_LAYOUT_KEYS = ("world_size", "tp", "pp", "cp", "dp_replicate", "dp_shard")
_TRAIN_STATE = {
    "step": lambda v: whole(v, 1),
    "skipped_steps": whole,
    "loader": lambda v: isinstance(v, dict),
    "scheduler": lambda v: isinstance(v, dict),
    "layout": lambda v: (
        isinstance(v, dict)
        and set(v) - {"ep"} == {*_LAYOUT_KEYS, "zero"}  # ep: recorded since expert parallelism
        and all(whole(v[k], 1) for k in (*_LAYOUT_KEYS, *({"ep"} & set(v))))
        and v["zero"] in (0, 1, 2, 3)
    ),
    "model": lambda v: isinstance(v, dict),
    "peft": lambda v: v is None or isinstance(v, dict),
    "init_from": lambda v: v is None or isinstance(v, str),
    "reference": lambda v: v is None or isinstance(v, dict),
    "run_dir": lambda v: isinstance(v, str) and v != "",
    "loss_scale": lambda v: isinstance(v, dict),
}


def _train_state_problem(state: dict) -> str | None:
    for key in ("step", "loader", "scheduler", "layout", "model"):
        if key not in state:
            return f"no {key}"
    if problem := first_problem(_TRAIN_STATE, state):
        return problem
    peft = state.get("peft") or {}
    for fields, value, name in (
        (_LOADER, state["loader"], "loader."),
        (_SCHEDULER, state["scheduler"], "scheduler."),
        (_LOSS_SCALE, state.get("loss_scale", {}), "loss_scale."),
        (_PEFT, peft, "peft."),
        (_BASE, peft.get("base", {}), "peft.base."),
        (_BASE, state.get("reference") or {}, "reference."),
    ):
        if problem := first_problem(fields, value, name, others=fields is _SCHEDULER):
            return problem
    if state.get("skipped_steps", 0) > state["step"]:
        return f"skipped_steps {state['skipped_steps']} is more than step {state['step']}"
    for key in ("consumed", "seed", "seq_len", "n_windows"):
        if key not in state["loader"]:
            return f"no loader.{key}"
    if state.get("peft") and set(_PEFT) - set(state["peft"]):
        return f"no peft.{min(set(_PEFT) - set(state['peft']))}"
    from meshtrain.model.args import model_record_problem

    if problem := model_record_problem(state["model"]):
        return f"model.{problem}" if not problem.startswith(("no ", "unknown")) else f"model: {problem}"
    return None


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
    except ValueError:
        marker = None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not _well_formed(marker, files):
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


def _well_formed(marker, files) -> bool:
    """A marker as a save writes it (not one edited by hand into another shape): its step, and the
    size and checksum of every file."""
    return (
        isinstance(files, dict)
        and isinstance(marker.get("step"), int)
        and all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), str)
            for e in files.values()
        )
    )


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories (committed or not), oldest first."""
    if not root.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
    return [p for _, p in steps]


def committed_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first."""
    return [p for p in step_dirs(root) if (p / MARKER).is_file()]


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def agreed_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint, verified by all ranks together (each a share of its files);
    every rank gets the same answer."""
    try:
        verify(path, rank_world())
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
