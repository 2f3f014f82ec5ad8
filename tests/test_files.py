"""files.py: every write is atomic, and a failing one is a one-line error that leaves the old file."""

import errno
import os
from pathlib import Path

import pytest

from meshtrain.files import WriteError, atomic_directory, ensure_room, write_text


@pytest.mark.parametrize(
    "err, fix",
    [
        (errno.ENOSPC, "free some space"),
        (errno.EROFS, "read-only"),
        (errno.EDQUOT, "quota"),
        (errno.EACCES, "permission"),
    ],
)
def test_a_failed_write_keeps_the_old_file_and_names_path_cause_and_fix(err, fix, tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    write_text(path, "old")

    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(WriteError) as e:
        write_text(path, "new")
    assert str(path) in str(e.value) and os.strerror(err) in str(e.value) and fix in str(e.value)
    assert "\n" not in str(e.value)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_a_directory_is_replaced_only_by_a_finished_one(tmp_path):
    out = tmp_path / "data"
    with atomic_directory(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("interrupted")
    assert (out / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_failed_rename_puts_the_finished_directory_back(tmp_path, monkeypatch):
    out = tmp_path / "data"
    with atomic_directory(out) as tmp:
        (tmp / "a").write_text("1")
    rename = Path.rename

    def cross_device(self, target):
        if self.name.startswith(".data.tmp-"):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", cross_device)
    with pytest.raises(WriteError, match=os.strerror(errno.EXDEV)):
        with atomic_directory(out) as tmp:
            (tmp / "a").write_text("2")
    assert (out / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_symlinked_directory_keeps_its_link_and_files_put_there_meanwhile(tmp_path):
    """A symlink to the output stays one (its target is replaced, from beside the target), and a file
    put into the output while its replacement was written is kept: the replacement is refused."""
    (tmp_path / "disk").mkdir()
    link = tmp_path / "export"
    link.symlink_to(tmp_path / "disk" / "export")
    for content in ("1", "2"):
        with atomic_directory(link) as tmp:
            (tmp / "a").write_text(content)
        assert link.is_symlink() and (link / "a").read_text() == content
    assert [p.name for p in (tmp_path / "disk").iterdir()] == ["export"]
    with pytest.raises(WriteError, match="gained notes.txt while its replacement was written"):
        with atomic_directory(link) as tmp:
            (tmp / "a").write_text("3")
            (link / "notes.txt").write_text("mine")
    assert (link / "a").read_text() == "2" and (link / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["export"]


def test_no_room_is_refused_before_writing(tmp_path):
    with pytest.raises(WriteError, match="no room for the weights"):
        ensure_room(tmp_path, 1e18, "the weights")
    ensure_room(tmp_path, 1, "the weights")


def test_an_output_file_replaces_only_an_earlier_output_of_its_command(tmp_path):
    """jobscript --out, plan --write-config and bench comm --out replace what they wrote before, but
    never someone else's file, nor an input given as a list (plan's --comm files)."""
    from meshtrain.errors import MeshtrainError
    from meshtrain.files import check_output

    out, comm = tmp_path / "job.sh", tmp_path / "comm.json"
    check_output(out, "--out", {}, "meshtrain", "meshtrain jobscript")  # nothing there yet
    out.write_text("#!/bin/bash\nsrun python -m meshtrain train\n")
    check_output(out, "--out", {}, "meshtrain", "meshtrain jobscript")
    out.write_text("#!/bin/bash\nmy own job\n")
    with pytest.raises(MeshtrainError, match=f"--out {out} exists and was not written by `meshtrain jobscript`"):
        check_output(out, "--out", {}, "meshtrain", "meshtrain jobscript")
    comm.write_text('[{"busbw_GBps": 1}]')
    with pytest.raises(MeshtrainError, match="is the --comm file it is made from"):
        check_output(comm, "--write-config", {"--comm": [str(out), str(comm)]}, "meshtrain", "meshtrain plan")
