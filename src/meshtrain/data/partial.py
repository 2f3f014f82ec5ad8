"""The partial directory of `data prepare`: `.<out>.partial` beside the output, where the output is
written and what a stopped prepare resumes from.

Besides the output's files as they are written (the tokenizer, each unit's shards) it holds the
bookkeeping, under hidden names so that the manifest's list of files never names it: `.spec.json`,
what decides the output bytes (inputs with their sizes and times, options), and `.unit-NNNNN.json`,
a finished unit's record (its commit mark). A prepare started again with the same spec keeps the
finished units; with another spec it starts afresh.

The manifest is written while the bookkeeping is still there, so a prepare stopped at the very end
(killed, or its output directory refused by the last check) resumes by finishing. The bookkeeping
goes only just before the directory is renamed into place, and the spec comes back if the rename
fails. A failed prepare keeps the directory where it holds finished units: a read error may be
passing, and an input fixed after a refusal has a new size and time, so its spec starts afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from meshtrain.data.format import FORMAT_VERSION, MANIFEST
from meshtrain.data.tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG
from meshtrain.errors import DataError
from meshtrain.files import atomic_write, replace_directory, sync_tree, write_json, writing
from meshtrain.lock import LOCK_NAME, RunLock
from meshtrain.logs import log

SPEC = ".spec.json"
LEGACY_SPEC = "spec.json"  # an earlier meshtrain's names: spec.json and unit-NNNNN.json, not hidden


def unit_record(work: Path, index: int) -> Path:
    return work / f".unit-{index:05d}.json"


def unit_done(work: Path, index: int) -> bool:
    """A unit is done once its record is written, and every unit is once the manifest is (the
    records go before the rename)."""
    return unit_record(work, index).is_file() or (work / MANIFEST).is_file()


def _sha256(path: Path) -> str | None:
    """A file's SHA-256, or None where there is no such file."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def make_spec(units: list, tokenizer, vocab_size, val_fraction, dtype, text_field, sample_bytes, chat) -> dict:
    """What decides the output bytes: a partial prepare started with another spec is not resumed. A
    given tokenizer's spec is its tokenizer.json and the two files beside it that name its eos and bos
    tokens (which end documents and chat turns), present or not."""
    files = {p.file.path: [p.file.size, p.file.mtime_ns] for u in units for p in u.pieces}
    beside = [Path(tokenizer).parent / name for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)] if tokenizer else []
    return json.loads(
        json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "units": [[[p.file.path, p.start, p.stop] for p in u.pieces] for u in units],
                "files": files,
                "tokenizer": _sha256(Path(tokenizer)) if tokenizer else None,
                "tokenizer_settings": {path.name: _sha256(path) for path in beside},
                "vocab_size": None if tokenizer else vocab_size,
                "sample_bytes": None if tokenizer else sample_bytes,
                "val_fraction": val_fraction,
                "dtype": dtype,
                "text_field": text_field,
                "format": chat.format if chat else "text",
                "chat": dataclasses.asdict(chat) if chat else None,
            }
        )
    )


def _adopt_legacy(work: Path) -> None:
    """A partial of an earlier meshtrain names its bookkeeping without the dot: renamed, its spec
    last (a stop midway leaves the spec to rename the rest the next time), so its units are kept."""
    if (work / LEGACY_SPEC).is_file():
        for old in [*work.glob("unit-*.json"), work / LEGACY_SPEC]:
            old.rename(work / f".{old.name}")


def open_partial(work: Path, spec: dict) -> RunLock:
    """Take the partial directory `work` (one prepare at a time) and resume what it holds if it was
    started with this spec; else empty it (only if it is a prepare's) and start afresh."""
    with writing(work):
        work.mkdir(parents=True, exist_ok=True)
    lock = RunLock(work).acquire()
    try:
        with writing(work):
            _adopt_legacy(work)
            _resume_or_empty(work, spec)
    except BaseException:
        lock.release()  # a refused directory keeps no lock of ours
        raise
    return lock


def _resume_or_empty(work: Path, spec: dict) -> None:
    """Keep what a prepare of this spec left in `work`, or empty a prepare's of another spec."""
    spec_path = work / SPEC
    try:
        same = json.loads(spec_path.read_text()) == spec
    except (OSError, ValueError):
        same = False
    if same:
        for leftover in work.glob(".*.tmp-*"):  # a killed worker's half-written shard
            leftover.unlink()
        n = len(spec["units"])
        done = n if (work / MANIFEST).is_file() else len(list(work.glob(".unit-*.json")))
        log.info(f"resuming the prepare in {work}: {done} of {n} units done")
        return
    entries = [p for p in work.iterdir() if not p.name.startswith(LOCK_NAME)]  # the lock, its temporaries
    if entries and not spec_path.is_file():
        raise DataError(f"{work} holds files that `meshtrain data prepare` did not write: move it away")
    if entries:
        log.info(f"{work}: a partial prepare of other inputs or options; starting afresh")
    for entry in entries:
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    write_json(spec_path, spec)


def finished_manifest(work: Path) -> dict | None:
    """The manifest of a partial that was stopped after writing it (it is written once every unit
    of this spec is done), without its list of files; None before."""
    if not (work / MANIFEST).is_file():
        return None
    manifest = json.loads((work / MANIFEST).read_text())
    manifest.pop("files", None)
    return manifest


def install(work: Path, out: Path, lock: RunLock, check: Callable[[], object]) -> None:
    """Rename the finished partial `work` into place as `out`. Its files are synced and `out` is
    checked again (`check`: hours may have passed, and someone may have put files there) while the
    bookkeeping is still there, so that a stop or a refusal leaves it resumable; then the
    bookkeeping goes, the spec last, and the directory is renamed (the spec put back if that fails)."""
    sync_tree(work)
    check()
    lock.release()
    with writing(work):
        spec = (work / SPEC).read_bytes()
        for leftover in work.glob(f"{LOCK_NAME}*"):  # a launcher's lock, a killed start's temporaries: not data
            leftover.unlink(missing_ok=True)
        for path in [*work.glob(".unit-*.json"), work / SPEC]:
            path.unlink()
    try:
        replace_directory(work, out)
    except BaseException:
        if work.is_dir():  # not renamed: the next run finishes it
            atomic_write(work / SPEC, lambda tmp: tmp.write_bytes(spec))
        raise


def after_failure(work: Path) -> None:
    """After a prepare failed on its input: keep the partial where it holds finished work, which the
    same command resumes from; else remove it, so that a refused input leaves nothing behind."""
    if any(work.glob(".unit-*.json")) or (work / MANIFEST).is_file():
        log.info(f"the finished units stay in {work}: the same command resumes from them (delete it to start afresh)")
    else:
        shutil.rmtree(work, ignore_errors=True)
