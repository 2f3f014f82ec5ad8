"""Fault injection for the recovery tests, loaded into every process of a run by putting this
directory on PYTHONPATH (Python imports `sitecustomize` at start-up), so that production code
carries no test hooks. Set in the run's environment:

  MESHTRAIN_FAIL_AT_STEP=N          rank MESHTRAIN_FAIL_RANK (default 0) dies as step N starts
  MESHTRAIN_FAIL_IN_SAVE_AT_STEP=N  that rank dies while committing the checkpoint of step N
  MESHTRAIN_HANG_IN_DATA_AT_STEP=N that rank's read of step N's batch never returns
  MESHTRAIN_HANG_IN_SAVE_AT_STEP=N that rank's checkpoint save of step N never returns
  MESHTRAIN_STEP_SLEEP=S            every step takes S seconds longer (time to signal a run mid-way)
  MESHTRAIN_SLOW_SAVE=N:S          that rank's checkpoint save of step N writes for S seconds: each item
                                    written, flushed, then a pause of 0.5 s (a slow file system)
  MESHTRAIN_ENOSPC_AT_STEP=N        every rank's checkpoint write of step N fails: "No space left on device"
  MESHTRAIN_STDOUT_PAUSE=S          every write to stdout is followed by S seconds of sleep (other
                                    processes' output lands between two writes)
  MESHTRAIN_RNG_PROBE=1             every step draws rank + 1 numbers from torch's generator (as dropout
                                    would); at the end each rank writes its generator's CRC to
                                    <run.dir>/rng-rank<R>.txt
  MESHTRAIN_KILL_IN_UNIT=N          `data prepare` SIGKILLs itself halfway through work unit N (after
                                    the unit's first document is written)
  MESHTRAIN_SLOW_START=RANK:S       that rank sleeps S seconds before anything else (a rank still
                                    starting while its peers already wait in the rendezvous)
  MESHTRAIN_REPORT_WAIT_S=S         a hang's reporting ranks wait S seconds (not 10) for the others'
                                    reports (train/watchdog.py REPORT_WAIT_S)
  MESHTRAIN_JITTER=SEED[:MAX_S]     a seeded random pause (0 to MAX_S, default 0.05 s) before every
                                    write, truncation, rename and deletion of run files (`make stress`):
                                    changes the relative speed of processes to shake out races

Faults fire on the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so an elastic restart recovers.
"""

import os
import sys


def _dies_here(var: str, step: int) -> bool:
    return (
        os.environ.get(var) == str(step)
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        and os.environ.get("MESHTRAIN_FAIL_RANK", "0") == os.environ.get("RANK", "0")
    )


def _die(what: str) -> None:
    print(f"[fault injection] rank {os.environ.get('RANK', '0')} dies {what}", flush=True)
    os._exit(1)


def _hang(what: str) -> None:
    import time

    print(f"[fault injection] rank {os.environ.get('RANK', '0')} hangs {what}", flush=True)
    while True:
        time.sleep(3600)


def _install() -> None:
    names = (
        "MESHTRAIN_FAIL_AT_STEP",
        "MESHTRAIN_FAIL_IN_SAVE_AT_STEP",
        "MESHTRAIN_HANG_IN_DATA_AT_STEP",
        "MESHTRAIN_HANG_IN_SAVE_AT_STEP",
        "MESHTRAIN_STEP_SLEEP",
        "MESHTRAIN_ENOSPC_AT_STEP",
        "MESHTRAIN_SLOW_SAVE",
        "MESHTRAIN_STDOUT_PAUSE",
        "MESHTRAIN_RNG_PROBE",
        "MESHTRAIN_JITTER",
        "MESHTRAIN_KILL_IN_UNIT",
        "MESHTRAIN_SLOW_START",
        "MESHTRAIN_REPORT_WAIT_S",
    )
    if not any(os.environ.get(n) for n in names):
        return
    if os.environ.get("MESHTRAIN_SLOW_START"):
        rank, seconds = os.environ["MESHTRAIN_SLOW_START"].split(":")
        if os.environ.get("RANK") == rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            import time

            time.sleep(float(seconds))
        return
    if os.environ.get("MESHTRAIN_KILL_IN_UNIT"):
        _kill_in_unit(int(os.environ["MESHTRAIN_KILL_IN_UNIT"]))
        return
    if os.environ.get("MESHTRAIN_STDOUT_PAUSE"):
        _pause_after_stdout_writes(float(os.environ["MESHTRAIN_STDOUT_PAUSE"]))
    if os.environ.get("MESHTRAIN_REPORT_WAIT_S"):
        import meshtrain.train.watchdog

        meshtrain.train.watchdog.REPORT_WAIT_S = float(os.environ["MESHTRAIN_REPORT_WAIT_S"])
    if "--nproc" in sys.argv and not os.environ.get("MESHTRAIN_JITTER"):
        return  # `train --nproc`'s own process only starts the workers: the patches below are for them
    import errno
    import time

    import torch.distributed.checkpoint as dcp

    from meshtrain.checkpoint.checkpointer import Checkpointer
    from meshtrain.data.loader import DistributedLoader

    next_batch, commit, checkpoint = DistributedLoader.next_batch, Checkpointer._commit, Checkpointer.save

    def faulty_next_batch(self):
        step = self.consumed // self.global_batch + 1
        if _dies_here("MESHTRAIN_FAIL_AT_STEP", step):
            _die(f"at step {step}")
        if _dies_here("MESHTRAIN_HANG_IN_DATA_AT_STEP", step):
            _hang(f"reading the batch of step {step}")
        time.sleep(float(os.environ.get("MESHTRAIN_STEP_SLEEP") or 0))
        if os.environ.get("MESHTRAIN_RNG_PROBE"):
            import torch

            torch.rand(int(os.environ.get("RANK", "0")) + 1)
        return next_batch(self)

    def faulty_commit(self, step, path, train_state):
        if _dies_here("MESHTRAIN_FAIL_IN_SAVE_AT_STEP", step):
            _die(f"during the save of step {step}")
        return commit(self, step, path, train_state)

    def hanging_save(self, step, *args, **kwargs):
        if _dies_here("MESHTRAIN_HANG_IN_SAVE_AT_STEP", step):
            _hang(f"saving the checkpoint of step {step}")
        return checkpoint(self, step, *args, **kwargs)

    Checkpointer.save = hanging_save
    save = dcp.save

    def full_disk_save(state, checkpoint_id, **kwargs):
        if checkpoint_id.endswith(f"step_{int(os.environ.get('MESHTRAIN_ENOSPC_AT_STEP') or -1):08d}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), checkpoint_id)
        return save(state, checkpoint_id=checkpoint_id, **kwargs)

    DistributedLoader.next_batch, Checkpointer._commit, dcp.save = faulty_next_batch, faulty_commit, full_disk_save
    if os.environ.get("MESHTRAIN_RNG_PROBE"):
        _write_rng_at_the_end()
    if os.environ.get("MESHTRAIN_SLOW_SAVE"):
        _slow_save(*os.environ["MESHTRAIN_SLOW_SAVE"].split(":"))
    if os.environ.get("MESHTRAIN_JITTER"):
        _jitter(os.environ["MESHTRAIN_JITTER"])


class _PausingStdout:
    def __init__(self, stream, seconds: float):
        self._stream, self._seconds = stream, seconds

    def write(self, text):
        n = self._stream.write(text)
        self._stream.flush()
        import time

        time.sleep(self._seconds)
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _pause_after_stdout_writes(seconds: float) -> None:
    import sys

    sys.stdout = _PausingStdout(sys.stdout, seconds)


def _kill_in_unit(unit: int) -> None:
    import signal

    from meshtrain.data.format import ShardWriter

    add = ShardWriter.add

    def add_then_die(self, ids, *args, **kwargs):
        add(self, ids, *args, **kwargs)
        if self.path.name.endswith(f"-{unit:05d}.bin"):
            self.files["tokens"].file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    ShardWriter.add = add_then_die


def _slow_save(step: str, seconds: str) -> None:
    import time

    import torch.distributed.checkpoint.filesystem as filesystem

    write_item, began = filesystem._write_item, {}

    def slow_write_item(transforms, stream, data, item, storage_key, *args, **kwargs):
        result = write_item(transforms, stream, data, item, storage_key, *args, **kwargs)
        path = str(getattr(stream, "name", ""))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        this_rank = os.environ.get("MESHTRAIN_FAIL_RANK", "0") == os.environ.get("RANK", "0")
        if f"step_{int(step):08d}" in path and first_attempt and this_rank:
            if not began:
                print(f"[fault injection] rank {os.environ.get('RANK', '0')} saves slowly", flush=True)
            stream.flush()  # the bytes reach the file system, then it is slow again
            if time.monotonic() - began.setdefault("at", time.monotonic()) < float(seconds):
                time.sleep(0.5)
        return result

    filesystem._write_item = slow_write_item


def _write_rng_at_the_end() -> None:
    import zlib
    from pathlib import Path

    import torch

    import meshtrain.train
    import meshtrain.train.loop

    train = meshtrain.train.loop.train

    def train_and_write_rng(cfg):
        result = train(cfg)
        crc = zlib.crc32(torch.get_rng_state().numpy().tobytes())
        Path(cfg.run.dir, f"rng-rank{os.environ.get('RANK', '0')}.txt").write_text(f"{crc:08x}\n")
        return result

    meshtrain.train.train = meshtrain.train.loop.train = train_and_write_rng


def _jitter(spec: str) -> None:
    import random
    import shutil
    import time

    import meshtrain.files
    from meshtrain.checkpoint.checkpointer import Checkpointer
    from meshtrain.metrics import MetricsLogger

    seed, _, most = spec.partition(":")
    rng = random.Random(f"{seed}:{os.environ.get('RANK', '0')}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    most_s = float(most or 0.05)

    def paused(fn):
        def call(*args, **kwargs):
            time.sleep(rng.uniform(0, most_s))
            return fn(*args, **kwargs)

        return call

    os.replace, os.rename, shutil.rmtree = paused(os.replace), paused(os.rename), paused(shutil.rmtree)
    meshtrain.files.atomic_write = paused(meshtrain.files.atomic_write)
    MetricsLogger.__init__, MetricsLogger.log = paused(MetricsLogger.__init__), paused(MetricsLogger.log)
    Checkpointer._commit, Checkpointer._prune = paused(Checkpointer._commit), paused(Checkpointer._prune)


_install()
