"""`meshtrain train --nproc N`: start N local workers through torch elastic (what torchrun runs)."""

from __future__ import annotations

import logging
import os
import signal

from meshtrain.logs import log

PREEMPTED_EXIT_CODE = 75  # what a worker returns after checkpointing on SIGTERM/SIGUSR1
INTERRUPTED_EXIT_CODE = 130  # ... and after checkpointing on SIGINT (Ctrl-C)
HANG_EXIT_CODE = 124  # a rank's watchdog found the job hung (train/watchdog.py): restart from the last checkpoint
# Signals the launcher passes on to its workers (which checkpoint and exit), and how long it waits
# for them before SIGKILL: a step and a checkpoint of a large model take minutes.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT_S = 600


def rendezvous_args(
    nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None, env: dict[str, str]
) -> list[str]:
    """torchrun's rendezvous options. One node: standalone, or at --master-port where one is given
    (two jobs on a shared node apart). --node-rank given: static rendezvous at --master-addr (like
    torchrun). One srun task per node: c10d rendezvous on the first Slurm host, keyed by the job id."""
    from meshtrain.launch.env import env_int, first_scheduler_host, port_from_job_id

    in_slurm_step = "SLURM_STEP_ID" in env and "SLURM_JOB_ID" in env
    if nnodes is None:
        nnodes = env_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", default=1) if in_slurm_step else 1
    if nnodes == 1 and master_addr is None and master_port is None:
        return ["--standalone"]
    job_id = env.get("SLURM_JOB_ID", "meshtrain")
    addr = master_addr or first_scheduler_host(env) or "127.0.0.1"
    port = master_port or port_from_job_id(job_id)
    if node_rank is not None:
        return [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--master-addr",
            addr,
            "--master-port",
            str(port),
        ]
    return ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{port}", "--rdzv-id", job_id]


def refuse_inside_a_launcher() -> None:
    """--nproc starts meshtrain's own launcher, whose workers never get --nproc: a process that was
    started by a launcher (RANK set: torchrun, srun with its environment, mpirun) and has --nproc
    would otherwise drop it and its options without a word. An srun task of one per node whose
    container hook set RANK (pyxis) is a node's launcher, as the agent-per-node script starts it."""
    from meshtrain.launch.env import container_hook_task, one_task_per_node

    if "RANK" in os.environ and not (container_hook_task(os.environ) and one_task_per_node(os.environ)):
        from meshtrain.errors import MeshtrainError

        raise MeshtrainError(
            f"--nproc starts meshtrain's own launcher, but this process was started by one (RANK="
            f"{os.environ['RANK']}): leave out --nproc and its options, or start meshtrain outside torchrun/srun/mpirun"
        )


def launch_workers(
    nproc: int,
    worker_argv: list[str],
    max_restarts: int = 0,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> int:
    """Run `python -m meshtrain <worker_argv>` in nproc processes on this node (torch elastic's
    agent); with several nodes, one such launcher per node. Returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Split the cores between workers instead of torchrun's blanket OMP_NUM_THREADS=1.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Restarted gloo workers otherwise reconnect to stale peers of the previous attempt
    # (pytorch#135712): measured 3/7 restarts succeeding without this, 9/9 with it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Our own line names each rank's exit code; torch elastic's error log would repeat it.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    rdzv = rendezvous_args(nnodes, node_rank, master_addr, master_port, dict(os.environ))
    # The workers must not take this launcher's Slurm task variables for their own ranks.
    for key in [k for k in os.environ if k.startswith(("SLURM_PROCID", "SLURM_LOCALID", "PMI_", "OMPI_COMM_WORLD"))]:
        os.environ.pop(key)
    argv = [
        *rdzv,
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.5",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "-m",
        "meshtrain",
        *worker_argv,
    ]
    try:
        run(get_args_parser().parse_args(argv))
    except SignalException as e:  # the agent has passed the signal on and waited for the workers to stop
        interrupted = e.sigval == signal.SIGINT
        log.warning(
            f"{'interrupted' if interrupted else 'preempted'} ({e.sigval.name}): the workers checkpointed "
            "and stopped; run the same command again to continue"
        )
        return INTERRUPTED_EXIT_CODE if interrupted else PREEMPTED_EXIT_CODE
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        # The agent stops the remaining workers with SIGTERM as soon as the first one exits.
        for code in (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE):
            if code in codes and codes <= {code, -signal.SIGTERM}:
                log.warning("stopped: a checkpoint was saved; run the same command again to continue")
                return code
        if HANG_EXIT_CODE in codes:
            log.error(
                f"the job hung (see the `hang:` line above and <run.dir>/hangs/); exit {HANG_EXIT_CODE}: run the "
                "same command again (or give --max-restarts); the `hang:` line says where it continues from"
            )
            return HANG_EXIT_CODE
        failures = "; ".join(f"rank {r}: exit code {f.exitcode}" for r, f in sorted(e.failures.items()))
        log.error(f"training failed ({failures}); see the worker output above")
        return 1
    return 0
