"""One job per run directory: `<run.dir>/.meshtrain.lock`, taken before anything is written.

Two jobs on one run directory delete each other's in-flight checkpoints, interleave metrics and
resume from each other's live state. The lock names its holder (host, pid, the process's start time,
the job it belongs to). A second job is refused in one line naming the holder. The same job coming
back keeps working: a torch elastic restart (the launcher holds the lock, its workers carry its
token), a requeued Slurm job (same job id), or any start after the holder died: a lock whose holder
is gone on this host (no such pid, or the pid now belongs to a younger process) is stale and taken
over. A holder on another host cannot be checked from here: the error says how to remove its lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.files import writing

LOCK_NAME = ".meshtrain.lock"
TOKEN_VARIABLE = "MESHTRAIN_RUN_LOCK"  # set by the holder for the processes it starts


class RunDirLocked(MeshtrainError):
    """Another job holds the run directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (a reused pid has a later one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def job_token() -> str:
    """What identifies this job across restarts of its processes: the token a holder passed down,
    else the scheduler's job id (a requeued job keeps it), else this process."""
    if os.environ.get(TOKEN_VARIABLE):
        return os.environ[TOKEN_VARIABLE]
    for key in ("SLURM_JOB_ID", "JOB_ID", "PBS_JOBID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(key) not in (None, "", "none"):  # torchrun's default rendezvous id is "none"
            return f"{key}={os.environ[key]}"
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _holder_alive(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # not ours to check
    started = _start_time(int(holder.get("pid", -1)))
    return started is not None and started == holder.get("started")


def _ancestors() -> set[int]:
    """This process and the ones above it (a launcher holding the lock for its workers)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def _same_job_elsewhere(holder: dict) -> bool:
    """A live process of this job on this host that is not this process nor its launcher: a second
    `meshtrain train` started in the same scheduler allocation, not the job coming back."""
    here = holder.get("host") == socket.gethostname()
    return here and _holder_alive(holder) and int(holder.get("pid", -1)) not in _ancestors()


class RunLock:
    def __init__(self, run_dir: Path | str, key: str = "run.dir"):
        self.path = Path(run_dir) / LOCK_NAME
        self.key = key  # the setting that names the directory, for the fix a refusal gives
        self.token = job_token()
        self.held = self.created_dir = False

    def acquire(self) -> RunLock:
        """Take the lock, or raise RunDirLocked naming the holder. Idempotent for the same job: a
        launcher above this process keeps holding it; an earlier start of the job that died here
        (a requeue, a retry) is taken over, so that the lock names a live holder."""
        self.created_dir = not self.path.parent.exists()
        with writing(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": _start_time(os.getpid()),
            "job": self.token,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        for _ in range(10):
            if self._create(me):
                self.held = True
                return self
            holder = self._read()
            if holder is not None and holder.get("job") == self.token and not _same_job_elsewhere(holder):
                if _holder_alive(holder):
                    return self  # this job's own lock: its launcher, or its start on another host
            else:
                self._refuse(holder)
            self._set_aside()  # stale: its holder died (or an unreadable lock)
        raise RunDirLocked(f"could not take {self.path}: other processes keep replacing it")

    def _create(self, me: dict) -> bool:
        """Create the lock holding `me`, or False where one exists. Written whole beside it and
        linked into place, so it is never seen empty; where the file system has no hard links
        (SMB, FUSE object stores), created exclusively and then written."""
        from meshtrain.files import write_error

        mine = self.path.with_name(f"{LOCK_NAME}.{socket.gethostname()}-{os.getpid()}")
        try:
            with writing(mine):
                mine.write_text(json.dumps(me))
            try:
                os.link(mine, self.path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV):
                    raise write_error(self.path, e) from None
        finally:
            with contextlib.suppress(OSError):
                mine.unlink(missing_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            time.sleep(0.05)  # it may be being written by its taker: read it after that
            return False
        except OSError as e:
            raise write_error(self.path, e) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return True

    def held_by_this_job(self) -> bool:
        """Whether this job (an earlier start of it: an elastic restart, a requeue) holds the lock;
        RunDirLocked if another live job does (checked without taking the lock)."""
        holder = self._read()
        if holder is not None and holder.get("job") == self.token and not _same_job_elsewhere(holder):
            return True
        self._refuse(holder)
        return False

    def _refuse(self, holder: dict | None) -> None:
        same_job = holder is not None and holder.get("job") == self.token
        if same_job and _same_job_elsewhere(holder):
            raise RunDirLocked(
                f"{self.path.parent} is in use by another process of this job (pid {holder.get('pid')}, since "
                f"{holder.get('since')}): give each run of the allocation its own {self.key}"
            ) from None
        if holder is not None and _holder_alive(holder):
            raise RunDirLocked(
                f"{self.path.parent} is in use by another job (host {holder.get('host')}, pid "
                f"{holder.get('pid')}, job {holder.get('job')}, since {holder.get('since')}): use another "
                f"{self.key}, or delete {self.path} if that job is gone"
            ) from None

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _set_aside(self) -> None:
        """Move a stale lock out of the way; of several processes doing this at once one succeeds,
        the others find it gone. Then each tries to create the lock anew (O_EXCL: one wins)."""
        stale = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, stale)
            stale.unlink()
        except FileNotFoundError:
            pass

    def release(self) -> None:
        if self.held:
            holder = self._read()
            if holder is not None and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
                if self.created_dir:  # a start that failed before writing anything leaves no empty directory
                    with contextlib.suppress(OSError):
                        self.path.parent.rmdir()
            self.held = False


class JobLocks:
    """One job's locks on each directory a run writes: run.dir, and checkpoint.dir where it lies
    outside it (two runs sharing it would resume, retire and prune each other's checkpoints). Taken
    all or none; the first decides whether this start is the job coming back."""

    def __init__(self, run_dir: Path | str, checkpoint_dir: Path | str | None = None):
        self.locks = [RunLock(run_dir)]
        if checkpoint_dir is not None:
            self.locks.append(RunLock(checkpoint_dir, "checkpoint.dir"))
        self.token = self.locks[0].token

    @property
    def held(self) -> bool:
        return self.locks[0].held

    def acquire(self) -> JobLocks:
        taken = []
        try:
            for lock in self.locks:
                taken.append(lock.acquire())
        except BaseException:
            for lock in taken:
                lock.release()
            raise
        return self

    def held_by_this_job(self) -> bool:
        """The run directory's answer; RunDirLocked if another live job holds any of them."""
        answers = [lock.held_by_this_job() for lock in self.locks]
        return answers[0]

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
