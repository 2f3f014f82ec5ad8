"""`meshtrain train --nproc N`: start N local workers through torch elastic (what torchrun runs)."""

from __future__ import annotations

import os
import sys


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
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        failures = "; ".join(f"rank {r}: exit code {f.exitcode}" for r, f in sorted(e.failures.items()))
        print(f"error: training failed ({failures}); see the worker output above", file=sys.stderr)
        return 1
    return 0
