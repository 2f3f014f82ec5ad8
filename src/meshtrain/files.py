"""Every file meshtrain writes goes through here: written under a temporary name, fsynced, renamed.

A reader (a resumed run, `meshtrain export`, a server) therefore sees the old file or the new one,
never half of one, and a failure (read-only file system, full disk, quota, permission) becomes one
line naming the path, the cause and the fix instead of a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from meshtrain.errors import MeshtrainError

FIXES = {
    errno.ENOSPC: "free some space or choose a directory on another file system",
    errno.EDQUOT: "free some of your quota or choose a directory on another file system",
    errno.EROFS: "the file system is read-only: choose a writable directory",
    errno.EACCES: "you lack permission there: choose a directory you own",
    errno.EPERM: "you lack permission there: choose a directory you own",
}


class WriteError(MeshtrainError):
    """A file or directory could not be written."""


def write_error(path: Path | str, e: OSError) -> WriteError:
    fix = FIXES.get(e.errno, "check the path and the file system")
    return WriteError(f"cannot write {path}: {e.strerror or e} ({fix})")


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Turn an OSError raised while writing `path` into a one-line WriteError."""
    try:
        yield
    except OSError as e:
        raise write_error(path, e) from None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()  # read once, at import (before any thread could create files meanwhile)


def _user_mode(path: Path) -> None:
    """The permissions the user's umask gives a new file: libraries that write through a private
    temporary file (safetensors, huggingface_hub) leave it 0600, and a server running as another
    user could not read the weights."""
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~UMASK)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path | str, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to produce the file at a temporary name beside `path`, then fsync and rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            _user_mode(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)
    return path


def check_output(
    path: Path | str,
    flag: str,
    inputs: dict[str, Path | str | list | None],
    signature: str | tuple[str, ...],
    command: str,
) -> None:
    """Before any work: an output file may replace an older output of `command` (a file holding
    `signature`, or one of several, in its first MiB), but never one of the command's own inputs (`inputs`: flag -> path
    or paths, e.g. the config a script is written from), a directory or someone else's file."""
    out = Path(path)
    if out.is_dir():
        raise MeshtrainError(f"{flag} {out} is a directory: name a file")
    if not out.exists():
        return
    for name, given in inputs.items():
        for each in given if isinstance(given, list) else [given]:
            if each and Path(each).exists() and out.samefile(each):
                raise MeshtrainError(f"{flag} {out} is the {name} file it is made from: write it to another path")
    if not out.is_file():
        raise MeshtrainError(f"{flag} {out} is not a regular file: name a file to write")
    try:
        with open(out, "rb") as f:
            head = f.read(1 << 20)
        ours = any(s.encode() in head for s in ((signature,) if isinstance(signature, str) else signature))
    except OSError as e:
        raise MeshtrainError(
            f"{flag} {out} cannot be read ({e.strerror}): move it away or write to another path"
        ) from None
    if not ours:
        raise MeshtrainError(
            f"{flag} {out} exists and was not written by `{command}`: move it away or write to another path"
        )


def write_text(path: Path | str, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path | str, obj, indent: int = 1) -> Path:
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


def copy_file(src: Path | str, dst: Path | str) -> Path:
    return atomic_write(dst, lambda tmp: shutil.copyfile(src, tmp))


@contextlib.contextmanager
def atomic_directory(out: Path | str) -> Iterator[Path]:
    """Yield a temporary directory beside `out` to fill; on success it replaces `out` (a finished
    directory is only ever replaced by a finished one); on failure it is removed. `out` is resolved:
    a symlink to the output keeps pointing at it and its target is replaced, on the target's file
    system. A file put into `out` while the directory was filled (checked before, by
    check_output_dir) is not deleted: the replacement is refused."""
    out = Path(out).resolve()
    before = _files_under(out) if out.is_dir() else set()
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    with writing(out):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        with writing(out):
            yield tmp
        _check_unchanged(out, before)
        sync_tree(tmp)
        replace_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_unchanged(out: Path, before: set[str]) -> None:
    """Refuse to replace `out` if it holds a file it did not hold when the work began."""
    if out.exists() and not out.is_dir():
        raise WriteError(f"{out} became a file while its replacement was written: move it away and run again")
    new = sorted(_files_under(out) - before) if out.is_dir() else []
    if new:
        raise WriteError(
            f"{out} gained {new[0]} while its replacement was written, and replacing it would delete that: "
            "move it away and run again, or choose another directory; nothing was changed"
        )


def sync_tree(directory: Path) -> None:
    """Give `directory` and everything under it the user's permissions, and sync its files to disk."""
    with writing(directory):
        for f in [directory, *directory.rglob("*")]:
            _user_mode(f)
            if f.is_file():
                with open(f, "rb+") as handle:
                    os.fsync(handle.fileno())


def replace_directory(tmp: Path, out: Path) -> None:
    """Make the finished directory `tmp`, its files synced (`sync_tree`), the directory `out`
    (resolved: a symlink is kept, its target replaced): renamed into place (an existing `out`, a
    finished one, is replaced only now, and put back if the rename fails)."""
    out = Path(out).resolve()
    with writing(out):
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            try:
                tmp.rename(out)
            except OSError:
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
        _fsync_dir(out.parent)


def check_output_dir(out: Path | str, inputs: list[Path | str], marker: str, command: str) -> Path:
    """Refuse, before any work, an output directory whose replacement would destroy what the user
    has: one that is or contains an input, a file, or a non-empty directory that `command` did not
    write (its own earlier output, recognised by `marker`, is replaced atomically)."""
    out = Path(out).resolve()
    for source in inputs:
        source = Path(source).resolve()
        if out == source or out in source.parents:
            what = "is" if out == source else "contains"
            raise WriteError(
                f"--out {out} {what} the input {source}: replacing it would delete the input; "
                "choose another output directory"
            )
    if out.exists() and not out.is_dir():
        raise WriteError(f"--out {out} is a file: choose a directory (new, empty, or an earlier output of `{command}`)")
    if out.is_dir() and any(out.iterdir()):
        written = _files_written(out / marker)
        if written is None:
            raise WriteError(
                f"--out {out} holds files that `{command}` did not write (no {marker} of its own): choose a new "
                "or empty directory; nothing was changed"
            )
        stranger = next((f for f in sorted(_files_under(out)) if f not in written and f != marker), None)
        if stranger is not None:
            raise WriteError(
                f"--out {out} holds {stranger}, which `{command}` did not write and replacing the directory would "
                "delete: move it away or choose another directory; nothing was changed"
            )
    return out


def _files_under(directory: Path) -> set[str]:
    """Every file under `directory`, as a path relative to it."""
    return {f.relative_to(directory).as_posix() for f in directory.rglob("*") if not f.is_dir()}


# What the markers of outputs written before they listed their files hold (a manifest's format_version
# and shards; an export's model or adapter_of): such an output is replaced whole, as it always was.
OLDER_MARKER_KEYS = {"manifest.json": ({"format_version", "shards"},), "meshtrain.json": ({"model"}, {"adapter_of"})}


def _files_written(marker: Path) -> set[str] | None:
    """The files an earlier output lists in its marker (mark_output), or None where the marker is
    missing, unreadable or not one of meshtrain's (a manifest.json of someone else's)."""
    try:
        record = json.loads(marker.read_text()) if marker.is_file() else None
        files = record.get("files") if record is not None else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    if files is None and any(keys <= set(record or {}) for keys in OLDER_MARKER_KEYS.get(marker.name, ())):
        return _files_under(marker.parent)  # written by an earlier meshtrain
    return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def mark_output(directory: Path, marker: str, record: dict) -> None:
    """Write the JSON marker of a finished output directory: `record` and the list of every file in
    it, so that a later run replaces the directory only if nothing else has been put there."""
    files = sorted(f for f in _files_under(directory) if f != marker and not f.startswith("."))
    write_json(directory / marker, record | {"files": files})


def ensure_room(directory: Path | str, need_bytes: float, what: str) -> None:
    """Refuse, before writing anything, `what` that the file system has no room for."""
    directory = Path(directory)
    with writing(directory):
        directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(directory).free
    if free < 1.05 * need_bytes:
        raise WriteError(
            f"no room for {what} in {directory}: it needs about {need_bytes / 1e9:.2f} GB and "
            f"{free / 1e9:.2f} GB are free; free some space or choose a directory on another file system"
        )


def read_json_object(path: Path) -> dict:
    """A JSON object file read from outside (config.json, generation_config.json, ...): {} where the
    file is missing or holds no object; invalid JSON refused in one line naming the file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MeshtrainError(f"{path} is not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def os_error_in(e: BaseException) -> BaseException:
    """The OSError behind wrappers such as DCP's (its CheckpointException holds each rank's failure), else e."""
    seen = set()
    stack = [e]
    while stack:
        err = stack.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [x for x in (err.__cause__, err.__context__) if x is not None]
    return e
