"""A stuck rank found and named instead of waited for.

Every rank's main thread marks the phase of the step it is in (`phase("data")`: two attribute
writes, nothing else); a watchdog thread on each rank checks once a second how long the current
phase has lasted. Each phase has its budget:

- a phase of a step: `training.hang_timeout`;
- the first step (the data loader's start-up, compilation, warm-up): `training.first_step_timeout`
  (default 5x the hang timeout);
- a checkpoint save or load: as long as it moves bytes. While a rank is in one and it progresses (a
  save: its shard files grow, or its main thread waits on the disk, as an fsync does; a load: its main
  thread reads), it
  stamps `<run.dir>/hangs/.progress/<start>.<rank>`; a rank past its limit in a save or load first
  looks there, and the job counts as hung only once no rank has moved a byte of one for the hang
  timeout. A slow file system is waited for; a frozen rank (SIGSTOP) stamps nothing. A rank past its
  limit anywhere else is hung whatever the stamps say.

When a phase outlasts its budget, the job is hung: a rank frozen, dead, or stuck in a read, a write or a
collective, with every other rank waiting for it. Then every live rank

1. agrees on one report directory `<run.dir>/hangs/<when>/` (the first to notice names it, by an
   atomic link; the others find it because their own phases are long by then: each rank looks for
   it once its phase has lasted half the limit);
2. writes `rank<R>.txt`: its host, pid, step and phase and how long it has been in it, then every
   thread's Python stack (faulthandler); on CUDA also NCCL's flight recorder (`nccl_rank<R>.pkl`);
3. waits a few seconds for the others' reports; the lowest reporting rank names, in one line and in
   `summary.txt`, the ranks that sent no report (frozen or dead) and those still in an earlier phase
   than the rest (stuck in it), and kills the non-reporting ranks of its own host (a stopped process
   does not act on SIGTERM, so the launcher would wait minutes for it);
4. exits with HANG_EXIT_CODE (124, as `timeout`): `--max-restarts`, the Slurm and SGE scripts and a
   rerun continue from the last committed checkpoint.

The process group's timeout is set above the longest limit, so the watchdog always speaks first
(checkpoints run their collectives on a group of their own, checkpoint/checkpointer.py, whose
timeout waits for the slowest save that progresses).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from meshtrain.launch.local import HANG_EXIT_CODE
from meshtrain.logs import log

PHASES = ("start", "load", "data", "forward/backward", "optimizer", "logging", "evaluation", "checkpoint", "save")
IO_PHASES = ("load", "save")  # a checkpoint's load and save: no limit while the job moves bytes
FIRST_STEP_FACTOR = 5  # the first step compiles and warms up (training.first_step_timeout's default)
REPORT_WAIT_S = 10.0  # how long a reporting rank waits for the others' reports
POLL_S = 1.0


class Phase:
    """The phase this process is in, as the main thread marks it (read by the watchdog thread)."""

    def __init__(self):
        self.name, self.step, self.since, self.first_step = "start", 0, time.monotonic(), True
        self.progress: Callable[[], int] | None = None

    def __call__(self, name: str, step: int | None = None, progress: Callable[[], int] | None = None) -> None:
        """`progress`: in a save or load, a count that grows while it moves bytes."""
        self.name, self.since, self.progress = name, time.monotonic(), progress
        if step is not None:
            self.step = step

    @contextlib.contextmanager
    def of(self, name: str, progress: Callable[[], int] | None = None):
        """`with phase.of("save", progress):` ... then back to the phase it interrupted."""
        before = self.name
        self(name, progress=progress)
        try:
            yield
        finally:
            self(before)


phase = Phase()  # process-wide, like faulthandler: the step marks it, the watchdog reads it


def first_step_limit(hang_timeout: float, first_step_timeout: float | None) -> float:
    return FIRST_STEP_FACTOR * hang_timeout if first_step_timeout is None else first_step_timeout


def process_group_timeout(hang_timeout: float, first_step_timeout: float | None = None) -> timedelta:
    """Above the watchdog's longest limit (the first step's), so that it reports first; without a
    watchdog, torch's usual 10 minutes."""
    if not hang_timeout:
        return timedelta(minutes=10)
    longest = max(hang_timeout, first_step_limit(hang_timeout, first_step_timeout))
    return timedelta(seconds=longest + 2 * REPORT_WAIT_S + 60)


def checkpoint_group_timeout(hang_timeout: float) -> timedelta | None:
    """A checkpoint's collectives wait for the slowest rank's save or load as long as it progresses:
    the watchdog, not the group, ends one that stopped moving bytes, and 6 hours bound a file system
    that stopped answering even the watchdog (without a watchdog: torch's default)."""
    return timedelta(hours=6) if hang_timeout else None


class Watchdog:
    """The watchdog thread of one rank (see the module docstring). `peers`: every rank's (host,
    pid), gathered at start; `attempt`: a name this start of the job shares on every rank."""

    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        world: int,
        timeouts: tuple[float, float | None],
        peers,
        attempt: str,
        device_type,
        checkpoints,
    ):
        """`timeouts`: the hang timeout and the first step's (None: 5x the hang timeout); `checkpoints`:
        the checkpoint root, whose newest committed step a rerun continues from."""
        self.root, self.rank, self.world = Path(run_dir) / "hangs", rank, world
        self.timeout, self.first_step_timeout = timeouts[0], first_step_limit(*timeouts)
        self.checkpoints = Path(checkpoints)
        self.peers, self.attempt, self.cuda = peers, attempt, device_type == "cuda"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="meshtrain-watchdog", daemon=True)
        self.progress_seen: tuple[float, int] | None = None  # (the phase's start, its progress count)
        phase("start", 0)
        phase.first_step = True

    def __enter__(self) -> Watchdog:
        if self.timeout:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * POLL_S)
        with contextlib.suppress(OSError):
            (self.root / ".progress" / f"{self.attempt}.{self.rank}").unlink(missing_ok=True)

    def first_step_done(self) -> None:
        phase.first_step = False

    def _watch(self) -> None:
        while not self.stop.wait(POLL_S):
            limit = self.first_step_timeout if phase.first_step else self.timeout
            elapsed = time.monotonic() - phase.since
            io = phase.name in IO_PHASES
            if io and self._moved() and elapsed > limit / 4:  # a quick save leaves no stamp
                self._stamp_progress()
            if elapsed > limit:
                if not (io and self._saving_or_loading()):
                    self._report(self._claim(), elapsed, limit)
            elif elapsed > limit / 2 and self.root.is_dir() and (name := self._claimed()):
                self._report(name, elapsed, limit)

    def _moved(self) -> bool:
        """Whether the save or load this rank is in progressed since the last poll, or its main thread
        waits on the disk (uninterruptible sleep: an fsync of its shards, a read the device serves)."""
        since, probe = phase.since, phase.progress
        count = probe() if probe is not None else 0
        seen, self.progress_seen = self.progress_seen, (since, count)
        return (seen is not None and seen[0] == since and count > seen[1]) or _main_thread_waits_on_disk()

    def _stamp_progress(self) -> None:
        """This rank's save or load moved bytes in the last second (the wall clock: ranks on other
        hosts compare it with theirs)."""
        with contextlib.suppress(OSError):
            where = self.root / ".progress"
            where.mkdir(parents=True, exist_ok=True)
            tmp = where / f".{self.attempt}.{self.rank}"
            tmp.write_text(f"{time.time()}")
            os.replace(tmp, where / f"{self.attempt}.{self.rank}")  # a reader never sees it half-written

    def _saving_or_loading(self) -> bool:
        """Whether some rank's checkpoint save or load moved bytes within the hang timeout."""
        newest = 0.0
        for path in (self.root / ".progress").glob(f"{self.attempt}.*"):
            with contextlib.suppress(OSError, ValueError):
                newest = max(newest, float(path.read_text()))
        return time.time() - newest < self.timeout

    def _claimed(self) -> str | None:
        try:
            return (self.root / f".{self.attempt}").read_text().strip() or None
        except OSError:
            return None

    def _claim(self) -> str:
        """The report directory's name: this rank's choice, or the one another rank made first."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = time.strftime("%Y%m%d-%H%M%S")
        tmp = self.root / f".{self.attempt}.{self.rank}"
        tmp.write_text(name)
        try:
            os.link(tmp, self.root / f".{self.attempt}")
        except FileExistsError:
            name = self._claimed() or name
        finally:
            tmp.unlink(missing_ok=True)
        return name

    def _report(self, name: str, elapsed: float, limit: float) -> None:
        where = self.root / name
        where.mkdir(parents=True, exist_ok=True)
        status = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "step": phase.step}
        status |= {"phase": phase.name, "seconds": round(elapsed, 1), "limit": limit, **_main_thread_place()}
        tmp = where / f".rank{self.rank}.txt"
        with open(tmp, "w") as f:
            f.write(json.dumps(status) + "\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        os.replace(tmp, where / f"rank{self.rank}.txt")
        if self.cuda:
            _dump_nccl_trace(where / f"nccl_rank{self.rank}.pkl")
        reports = self._gather(where)
        if self.rank == min(reports):
            self._summarize(where, reports, limit)
        else:  # stay until it is written: a rank that exits breaks its peers' collectives, and they die
            deadline = time.monotonic() + REPORT_WAIT_S
            while not (where / "summary.txt").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def _gather(self, where: Path) -> dict[int, dict]:
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            reports = {}
            for path in where.glob("rank*.txt"):
                with contextlib.suppress(OSError, ValueError):
                    status = json.loads(path.read_text().split("\n", 1)[0])
                    reports[status["rank"]] = status
            if len(reports) == self.world or time.monotonic() > deadline:
                return reports
            time.sleep(0.5)

    def _summarize(self, where: Path, reports: dict[int, dict], limit: float) -> None:
        silent = [r for r in range(self.world) if r not in reports]
        order = {name: i for i, name in enumerate(PHASES)}
        progress = {r: (s["step"], order.get(s["phase"], 0)) for r, s in reports.items()}
        ahead = max(progress.values())
        behind = sorted(r for r, p in progress.items() if p < ahead)
        waiting = sorted(r for r, p in progress.items() if p == ahead)
        parts = []
        if silent:
            parts.append(f"{_ranks(silent)} sent no report (frozen or dead)")
        if behind:
            parts.append(f"{_ranks(behind)} did not finish " + _each(behind, reports, "{phase} of step {step}"))
        elif not silent:  # one phase: those not waiting in a collective hold up those that are
            busy = [r for r in waiting if not reports[r]["collective"]]
            if busy and len(busy) < len(waiting):
                waiting = [r for r in waiting if r not in busy]
                collective = reports[waiting[0]]["collective"]
                parts.append(f"{_ranks(busy)} did not arrive at {collective}, held at " + _each(busy, reports, "{at}"))
        culprit = "; ".join(parts) or "every rank is stuck in the same phase"
        first = reports[waiting[0]]
        line = (
            f"hang: {culprit}; {_ranks(waiting)} waited over {limit:.0f} s in {first['phase']} of step "
            f"{first['step']}. Stacks in {where}/; exiting {HANG_EXIT_CODE}: {self._rerun()}"
        )
        (where / "summary.txt").write_text(line + "\n")
        log.error(line)
        self._kill_local(silent)

    def _rerun(self) -> str:
        """What running the job again does: continue from the newest checkpoint, or start over."""
        from meshtrain.checkpoint import committed_checkpoints

        committed = committed_checkpoints(self.checkpoints)
        if committed:
            return f"a rerun continues from {committed[-1]}"
        return "no checkpoint was saved, so a rerun starts again at step 1 (this start's metrics are kept)"

    def _kill_local(self, silent: list[int]) -> None:
        """SIGKILL the silent ranks of this host that are still meshtrain processes."""
        host = socket.gethostname()
        for rank in silent:
            peer_host, pid = self.peers[rank]
            if peer_host != host:
                continue
            with contextlib.suppress(OSError):
                if b"meshtrain" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def main_thread_io() -> int:
    """The bytes the main thread has read and written so far (Linux; elsewhere 0: nothing is seen to
    move, and a load has the hang timeout as its limit). Other threads' output (a progress bar's
    redraws, this watchdog's own reads) is not counted."""
    try:
        text = Path(f"/proc/self/task/{threading.main_thread().native_id}/io").read_text()
        fields = dict(line.split(": ") for line in text.splitlines())
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, ValueError, KeyError):
        return 0


def _main_thread_waits_on_disk() -> bool:
    """The main thread is in uninterruptible sleep (state D: a disk or network file system serving it;
    Linux). A frozen process's watchdog does not run, so it never says this of a stopped rank."""
    try:
        text = Path(f"/proc/self/task/{threading.main_thread().native_id}/stat").read_text()
        return text.rsplit(")", 1)[1].split()[0] == "D"
    except (OSError, IndexError):
        return False


def _main_thread_place() -> dict:
    """Where the main thread is: the collective it waits in (a torch.distributed call), if any, and
    its innermost frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = traceback.extract_stack(frame) if frame is not None else []
    collective = next(
        (f.name for f in stack if f.filename.endswith(("distributed_c10d.py", "_functional_collectives.py"))), None
    )
    at = f"{Path(stack[-1].filename).name}:{stack[-1].lineno} in {stack[-1].name}" if stack else "unknown"
    return {"collective": collective, "at": at}


def _each(ranks: list[int], reports: dict[int, dict], form: str) -> str:
    """`form` filled from one rank's report, or from each, named: "rank 1: ..., rank 3: ..."."""
    if len(ranks) == 1:
        return form.format(**reports[ranks[0]])
    return ", ".join(f"rank {r}: " + form.format(**reports[r]) for r in ranks)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _dump_nccl_trace(path: Path) -> None:
    """NCCL's flight recorder (the last collectives of every process group), where torch has it."""
    with contextlib.suppress(Exception):
        import torch

        path.write_bytes(torch._C._distributed_c10d._dump_nccl_trace())


def enable_flight_recorder() -> None:
    """Before the process group exists: NCCL records its last collectives (read on a hang)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
