"""`meshtrain train`: one process, its own local launcher (--nproc), a worker of any launcher, or a
dry run of the job at any world size (--dry-run WORLD)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from meshtrain.cli.options import add_config_keys, add_options, options_of
from meshtrain.config import option
from meshtrain.errors import MeshtrainError


@dataclass
class TrainOptions:
    config: str | None = None
    """TOML config file (default: built-in defaults = configs/tiny.toml)."""
    nproc: int | None = option(None, ge=1)
    """Start this many local worker processes (torch elastic)."""
    max_restarts: int | None = option(None, ge=0)
    """Restart failed workers up to this many times (default 0)."""
    nnodes: int | None = option(None, ge=1)
    """Nodes, each running one `meshtrain train --nproc G` (default: the Slurm allocation's when run as one
    srun task per node, else 1)."""
    node_rank: int | None = option(None, ge=0)
    """This node's index (static rendezvous at --master-addr)."""
    master_addr: str | None = None
    """The first node's address (default: the first Slurm host)."""
    master_port: int | None = option(None, ge=1, le=65535)
    """Rendezvous port (default: derived from the job id)."""
    dry_run: int | None = option(None, ge=1)
    """Build the job for WORLD ranks in this process on a fake process group (nothing allocated) and print
    its busiest ranks' memory beside the planner's; nothing is trained."""
    dry_run_rank: list[int] = option(default_factory=list, ge=0)
    """With --dry-run: this rank (repeatable)."""
    json: bool = False
    """With --dry-run: print JSON."""


def add_parser(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train a model (any launcher, any layout)",
        usage="meshtrain train [--config FILE] [--nproc N] [launcher options] [--section.key VALUE ...]",
        epilog="Config keys as --section.key VALUE (or --section.key=VALUE) override the file. The "
        "launcher options (--nnodes, --node-rank, --master-addr, --master-port, --max-restarts) "
        "need --nproc.",
    )
    add_options(t, TrainOptions)
    add_config_keys(t)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshtrain.config import load_config

    o: TrainOptions = options_of(args, TrainOptions)
    cfg = load_config(o.config, overrides)
    launcher_flags = {
        "--nnodes": o.nnodes,
        "--node-rank": o.node_rank,
        "--master-addr": o.master_addr,
        "--master-port": o.master_port,
        "--max-restarts": o.max_restarts,
    }
    given = [flag for flag, value in launcher_flags.items() if value is not None]
    if given and o.nproc is None:
        raise MeshtrainError(
            f"{', '.join(given)} configure meshtrain's own launcher: add --nproc N (workers per "
            "node), or leave them to your launcher (torchrun, srun, mpirun)"
        )
    if o.node_rank is not None and o.node_rank >= (o.nnodes or 1):
        raise MeshtrainError(f"--node-rank {o.node_rank} must be below --nnodes ({o.nnodes or 1})")
    if o.dry_run is None and (o.dry_run_rank or o.json):
        raise MeshtrainError(f"{'--dry-run-rank' if o.dry_run_rank else '--json'} goes with --dry-run WORLD")
    if o.dry_run is not None:
        if o.nproc is not None or given:
            raise MeshtrainError("--dry-run builds the job in this one process: leave out --nproc and its options")
        return _dry_run(cfg, o)
    if o.nproc is not None:
        from meshtrain.launch.local import refuse_inside_a_launcher

        refuse_inside_a_launcher()
        return _launch(cfg, o, overrides)

    from meshtrain.train.loop import train

    return train(cfg)["exit_code"]


def _launch(cfg, o: TrainOptions, overrides: list[str]) -> int:
    """Prepare the data and resolve the job once, before any worker starts; hold the run directory
    for the whole job, across its workers' restarts (on a multi-node job started by hand: node 0's
    launcher); start the workers."""
    from meshtrain.checkpoint import (
        checkpoint_root,
        continue_job,
        job_locks,
        refuse_another_lineage,
        refuse_overwriting_results,
    )
    from meshtrain.job import resolve
    from meshtrain.job.data import ensure_dataset
    from meshtrain.job.device import check_device, workers_device
    from meshtrain.job.launch import check_local_launch
    from meshtrain.launch.distributed import require_device
    from meshtrain.launch.env import env_int
    from meshtrain.launch.local import launch_workers
    from meshtrain.lock import TOKEN_VARIABLE
    from meshtrain.logs import setup_logging

    setup_logging(0, cfg.run.log_level)
    check_local_launch(cfg, o.max_restarts)
    nodes = o.nnodes or env_int(os.environ, "SLURM_STEP_NUM_NODES", default=1)
    require_device(cfg.launch.device)
    cfg = continue_job(cfg)  # a requeued job; its workers, restarted by torch elastic, decide again
    refuse_another_lineage(cfg.checkpoint.resume, checkpoint_root(cfg))
    lock = job_locks(cfg)  # node 0's launcher holds them for the job; it alone checks the run dir
    if not o.node_rank and not lock.held_by_this_job():  # else this is the job itself, requeued
        refuse_overwriting_results(cfg.checkpoint.resume, checkpoint_root(cfg), Path(cfg.run.dir))
    resolve(cfg, o.nproc * nodes)  # what needs no data is refused before the data is prepared
    dataset = ensure_dataset(cfg)  # once, before any worker starts; also surfaces data errors here
    resolve(cfg, o.nproc * nodes, dataset)
    check_device(cfg, workers_device(cfg), launcher=True)
    if not o.node_rank:
        lock.acquire()
        os.environ[TOKEN_VARIABLE] = lock.token  # the workers it starts belong to this job
    try:
        worker_argv = ["train", *(["--config", o.config] if o.config else []), *overrides]
        return launch_workers(
            o.nproc, worker_argv, o.max_restarts or 0, o.nnodes, o.node_rank, o.master_addr, o.master_port
        )
    finally:
        lock.release()


def _dry_run(cfg, o: TrainOptions) -> int:
    from meshtrain.job.data import check_objective_data, default_corpus_pending
    from meshtrain.train.dry_run import KEYS, dry_run

    if default_corpus_pending(cfg):  # train would prepare the default corpus here: plain text
        check_objective_data(cfg, None)

    reports = dry_run(cfg, o.dry_run, o.dry_run_rank)
    if o.json:
        print(json.dumps({"world": o.dry_run, "ranks": [r.as_dict() for r in reports]}, indent=2))
        return 0

    def size(n: float | None) -> str:
        return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    print(f"dry run: the job built for {o.dry_run} ranks; per rank, built (measured on fake tensors) / planned")
    for r in reports:
        where = ", ".join(f"{k} {v}" for k, v in r.coordinates.items())
        print(
            f"rank {r.rank} ({where}): "
            + " | ".join(f"{k} {size(r.built.get(k))} / {size(r.planned[k])}" for k in KEYS)
        )
        for note in r.notes:
            print(f"  {note}")
    return 0
