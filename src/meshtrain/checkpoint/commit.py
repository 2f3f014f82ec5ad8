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

MARKER = "COMMITTED.json"
TRAIN_STATE = "train_state.json"
STEP_DIR = re.compile(r"step_(\d+)$")


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
