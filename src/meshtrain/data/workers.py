"""Where the work of `data prepare` runs: worker processes on this node, and the ranks of a job
(srun, mpirun, torchrun, SGE) that share one gloo process group."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from meshtrain.errors import MeshtrainError


def default_workers() -> int:
    """Every core this process may run on (a Slurm or cgroup limit included)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _worker_start() -> None:
    """A worker tokenizes on its one core (the parallelism is the workers) and dies with prepare."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from meshtrain.launch.distributed import die_with_parent

    die_with_parent()


@contextlib.contextmanager
def _one_thread_tokenizing() -> Iterator[None]:
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def run_units(task: Callable[[Any], object], units: list, workers: int, progress: bool) -> None:
    """task(unit) for each of `units` (work units with a `size` in bytes, for the progress bar) on
    `workers` processes, or in this one for a single worker; `task` is pickled to them (a
    module-level function or a partial of one)."""
    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        done = bar.add_task("tokenizing", total=sum(u.size for u in units))
        if workers == 1 or len(units) <= 1:  # none left (a resumed partial, a rank without a share): done
            with _one_thread_tokenizing():
                for unit in units:
                    task(unit)
                    bar.advance(done, unit.size)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ProcessPoolExecutor(min(workers, len(units)), mp_context=context, initializer=_worker_start) as pool:
            futures = {pool.submit(task, unit): unit for unit in units}
            try:
                for future in as_completed(futures):
                    future.result()
                    bar.advance(done, futures[future].size)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise


class Ranks:
    """This process's part in a prepare run by several ranks (alone without a process group)."""

    def __init__(self, distributed: bool):
        self.dist = None
        if distributed:
            import torch.distributed as dist

            self.dist = dist if dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world = self.dist.get_world_size() if self.dist else 1

    def everyone(self, fn: Callable[[], object]):
        """fn() on every rank; if it fails on any rank, every rank raises that rank's one-line error."""
        try:
            result, error = fn(), None
        except MeshtrainError as e:
            result, error = None, (type(e), str(e))
        if self.dist:
            errors: list = [None] * self.world
            self.dist.all_gather_object(errors, error)
            failed = next(((r, e) for r, e in enumerate(errors) if e), None)
            if failed:
                rank, (kind, message) = failed
                raise kind(message if rank == self.rank else f"rank {rank}: {message}")
        elif error:
            raise error[0](error[1])
        return result

    def from_first(self, fn: Callable[[], object]):
        """fn() on rank 0, its result on every rank (its error raised on every rank)."""
        result = self.everyone(lambda: fn() if self.rank == 0 else None)
        if self.dist:
            box = [result]
            self.dist.broadcast_object_list(box, src=0)
            result = box[0]
        return result
